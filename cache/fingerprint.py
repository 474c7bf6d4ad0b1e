"""The serving fingerprint: what names every cache entry of one model configuration (KV blocks, exact
answers, compile artifacts), so that no entry is read by a configuration that did not write it.

The engine computes it, and so does the scheduler step, which hashes each request's exact response key
ahead of the engine (in its own process, off the engine's GIL). Both compute it here from the same
model parameters; an engine that finds a key of another fingerprint hashes its own.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, BinaryIO

from cache.traffic_stats import model_fingerprint


def model_max_len(model_dir: Path, max_seq_len: int) -> int:
    """The served sequence limit: the parameter, capped by the checkpoint's position embeddings."""
    limit = json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings") or max_seq_len
    return min(max_seq_len, int(limit))


def model_vocab_size(model_dir: Path) -> int | None:
    """The checkpoint's logits width (config.json's vocab_size: the lm_head's outputs in every supported
    model type), or None where no config.json says: the exact key then holds top_k as sent. The
    scheduler step and the engine both read it here, so that their keys agree."""
    path = Path(model_dir) / "config.json"
    size = json.loads(path.read_text()).get("vocab_size") if path.is_file() else None
    return size if type(size) is int and size > 0 else None


# files besides config.json that change what the model answers or how text maps to tokens
IDENTITY_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
WEIGHT_SAMPLES = 64  # evenly spaced reads per weight file: a fine-tune changes values everywhere
WEIGHT_SAMPLE_BYTES = 65536
TENSOR_SAMPLE_BYTES = 4096  # per tensor of a safetensors file: its first, middle and last bytes
_SAFETENSORS_MAX_HEADER = 100 * 1024 * 1024  # the format's own limit


def checkpoint_digest(model_dir: Path) -> str:
    """What config.json does not say about a checkpoint: the tokenizer and generation files' bytes, and
    each weight file's name, size and 64 evenly spaced 64 KiB samples of its bytes. Retrained weights
    under the same config.json get another fingerprint, so no replica serves the old model's cached KV
    or answers, and reading 4 MiB a file keeps it cheap for a checkpoint of any size."""
    digest = hashlib.sha256()
    for name in IDENTITY_FILES:
        path = model_dir / name
        if path.is_file():
            data = path.read_bytes()
            digest.update(f"{name}:{len(data)}:".encode() + data)
    for path in sorted(model_dir.iterdir()):
        if path.suffix not in WEIGHT_SUFFIXES or not path.is_file():
            continue
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}:".encode())
        with path.open("rb") as f:
            span = max(0, size - WEIGHT_SAMPLE_BYTES)
            for k in range(WEIGHT_SAMPLES):
                f.seek(span * k // (WEIGHT_SAMPLES - 1))
                digest.update(f.read(WEIGHT_SAMPLE_BYTES))
            if path.suffix == ".safetensors":
                _tensor_samples(f, size, digest)
    return digest.hexdigest()[:16]


def _tensor_samples(f: BinaryIO, size: int, digest: Any) -> None:
    """Every tensor of a safetensors file read at its start, middle and end: evenly spaced windows miss
    whole tensors (in the tiny model 13 of 40, `v_proj` of three layers among them), and a fine-tune or a
    LoRA merge that changes only those changes every value of them, so one window inside each is enough.
    A file whose header does not parse keeps the evenly spaced windows alone."""
    f.seek(0)
    head = f.read(8)
    if len(head) < 8:
        return
    n = int.from_bytes(head, "little")
    if n > min(_SAFETENSORS_MAX_HEADER, size - 8):
        return
    try:
        header = json.loads(f.read(n))
    except (ValueError, RecursionError):  # not a safetensors header (UnicodeDecodeError included)
        return
    if not isinstance(header, dict):
        return
    base = 8 + n
    digest.update(b"safetensors-tensors-v1")
    for name in sorted(k for k in header if k != "__metadata__"):
        offsets = header[name].get("data_offsets") if isinstance(header[name], dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            continue
        start, end = base + offsets[0], base + offsets[1]
        if not 0 <= start <= end <= size:
            continue
        digest.update(f"{name}:{offsets[0]}:{offsets[1]}:".encode())
        last = max(start, end - TENSOR_SAMPLE_BYTES)
        for at in sorted({start, start + (last - start) // 2, last}):
            f.seek(at)
            digest.update(f.read(min(TENSOR_SAMPLE_BYTES, end - at)))


def serving_fingerprint(model_dir: Path, max_len: int, dtype: str) -> str:
    """The checkpoint's config and sequence limit, its tokenizer and weights (`checkpoint_digest`), the
    weights' dtype and the KV layout."""
    return f"{model_fingerprint(model_dir, max_len)}|{checkpoint_digest(Path(model_dir))}|{dtype}|slot-kv-v1"
