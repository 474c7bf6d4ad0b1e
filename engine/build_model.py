"""Build a servable Hugging Face causal LM directory without downloading anything.

    python -m engine.build_model --preset tiny --out models/tiny-llama
    python -m engine.build_model --preset 1b --out models/llama-1b

Trains a byte-level BPE tokenizer on ``data/corpus.txt`` with ``tokenizers``, wraps it in
``PreTrainedTokenizerFast`` and builds a ``LlamaForCausalLM`` with seeded random weights; everything is
written with ``save_pretrained`` so the real loading code (``AutoTokenizer``/``AutoModelForCausalLM``,
``tokenizers.Tokenizer.from_file``) runs against it. Needs only torch, transformers and tokenizers (it also
runs on the GPU image). Idempotent: a build stamp in the output directory records the inputs, and a
matching build is skipped.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CORPUS = REPO_ROOT / "data" / "corpus.txt"
STAMP_NAME = "build_stamp.json"
BUILD_VERSION = 1  # bump when the build recipe changes in a way that must invalidate old builds

BOS, EOS, PAD, UNK = "<s>", "</s>", "<pad>", "<unk>"
SPECIAL_TOKENS = [BOS, EOS, PAD, UNK]  # ids 0, 1, 2, 3


@dataclass(frozen=True)
class Preset:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    max_position_embeddings: int
    dtype: str


PRESETS: dict[str, Preset] = {
    # ~7M parameters: shows the cold-start effect on a CPU in milliseconds
    "tiny": Preset(256, 4, 4, 2, 688, 2048, "float32"),
    # ~0.76B parameters with the 8192-token vocabulary (Llama-1B-like body), bf16 on disk
    "1b": Preset(2048, 16, 32, 8, 5632, 4096, "bfloat16"),
}


def log(msg: str) -> None:
    print(f"[build_model] {msg}", flush=True)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def train_tokenizer(corpus: Path, vocab_size: int):
    """Byte-level BPE (GPT-2 style) with <s> prepended by the post-processor."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(corpus)], trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tok


def build(
    preset: str,
    out: Path,
    seed: int = 0,
    dtype: str | None = None,
    vocab_size: int = 8192,
    corpus: Path = DEFAULT_CORPUS,
    force: bool = False,
) -> Path:
    """Build (or reuse) a model directory; returns ``out``."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    p = PRESETS[preset]
    dtype = dtype or p.dtype
    out = Path(out)
    corpus = Path(corpus)
    stamp = {
        "version": BUILD_VERSION,
        "preset": preset,
        "architecture": asdict(p),
        "seed": seed,
        "dtype": dtype,
        "vocab_size": vocab_size,
        "corpus_sha256": _sha256(corpus),
    }
    stamp_path = out / STAMP_NAME
    if not force and stamp_path.is_file() and (out / "tokenizer.json").is_file():
        try:
            if json.loads(stamp_path.read_text()) == stamp:
                log(f"{out}: up to date (preset {preset}, seed {seed}, {dtype}); skipping")
                return out
        except ValueError:
            pass

    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise ValueError(f"unknown --dtype {dtype!r} (e.g. float32, bfloat16, float16)")

    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    stamp_path.unlink(missing_ok=True)  # a half-written build must not look complete

    log(f"training byte-level BPE tokenizer (vocab {vocab_size}) on {corpus} ({corpus.stat().st_size} bytes)")
    tok = train_tokenizer(corpus, vocab_size)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,
        model_max_length=p.max_position_embeddings,
    )
    fast.save_pretrained(out)
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    log(f"tokenizer: {tok.get_vocab_size()} tokens, special ids {ids}")

    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=p.hidden_size,
        intermediate_size=p.intermediate_size,
        num_hidden_layers=p.num_hidden_layers,
        num_attention_heads=p.num_attention_heads,
        num_key_value_heads=p.num_key_value_heads,
        max_position_embeddings=p.max_position_embeddings,
        bos_token_id=ids[BOS],
        eos_token_id=ids[EOS],
        pad_token_id=ids[PAD],
        tie_word_embeddings=False,
    )
    log(
        f"building LlamaForCausalLM preset {preset} (hidden {p.hidden_size}, {p.num_hidden_layers} layers, "
        f"{p.num_attention_heads} heads / {p.num_key_value_heads} kv) with seed {seed}"
    )
    # Initialise in float32 on the CPU so the weights for a seed do not depend on the target dtype
    # or on the machine, then cast.
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model = model.to(torch_dtype).eval()
    n_params = sum(t.numel() for t in model.parameters())
    model.generation_config = GenerationConfig(
        bos_token_id=ids[BOS],
        eos_token_id=ids[EOS],
        pad_token_id=ids[PAD],
        max_length=p.max_position_embeddings,
    )
    log(f"saving {n_params / 1e6:.1f}M parameters as {dtype} safetensors to {out}")
    model.save_pretrained(out)
    del model

    stamp_path.write_text(json.dumps(stamp, indent=2) + "\n")
    log(f"done in {time.perf_counter() - t0:.1f} s: {out}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--out", type=Path, required=True, help="output model directory")
    ap.add_argument("--seed", type=int, default=0, help="torch.manual_seed for the random weights")
    ap.add_argument("--dtype", default=None, help="weights dtype on disk (default: the preset's)")
    ap.add_argument("--vocab-size", type=int, default=8192, help="BPE vocabulary size")
    ap.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS, help="tokenizer training text")
    ap.add_argument("--force", action="store_true", help="rebuild even if the build stamp matches")
    a = ap.parse_args(argv)
    try:
        build(
            a.preset,
            a.out,
            seed=a.seed,
            dtype=a.dtype,
            vocab_size=a.vocab_size,
            corpus=a.corpus,
            force=a.force,
        )
    except (ValueError, FileNotFoundError) as e:
        print(f"[build_model] error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
