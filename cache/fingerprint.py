"""The serving fingerprint: what names every cache entry of one model configuration (KV blocks, exact
answers, compile artifacts), so that no entry is read by a configuration that did not write it.

The engine computes it, and so does the scheduler step, which hashes each request's exact response key
ahead of the engine (in its own process, off the engine's GIL). Both compute it here from the same
model parameters; an engine that finds a key of another fingerprint hashes its own.
"""

from __future__ import annotations

import json
from pathlib import Path

from cache.traffic_stats import model_fingerprint


def model_max_len(model_dir: Path, max_seq_len: int) -> int:
    """The served sequence limit: the parameter, capped by the checkpoint's position embeddings."""
    limit = json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings") or max_seq_len
    return min(max_seq_len, int(limit))


def serving_fingerprint(model_dir: Path, max_len: int, dtype: str) -> str:
    """The checkpoint's config and sequence limit, the weights' dtype and the KV layout."""
    return model_fingerprint(model_dir, max_len) + f"|{dtype}|slot-kv-v1"
