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

from cache.traffic_stats import model_fingerprint


def model_max_len(model_dir: Path, max_seq_len: int) -> int:
    """The served sequence limit: the parameter, capped by the checkpoint's position embeddings."""
    limit = json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings") or max_seq_len
    return min(max_seq_len, int(limit))


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
    return digest.hexdigest()[:16]


def serving_fingerprint(model_dir: Path, max_len: int, dtype: str) -> str:
    """The checkpoint's config and sequence limit, its tokenizer and weights (`checkpoint_digest`), the
    weights' dtype and the KV layout."""
    return f"{model_fingerprint(model_dir, max_len)}|{checkpoint_digest(Path(model_dir))}|{dtype}|slot-kv-v1"
