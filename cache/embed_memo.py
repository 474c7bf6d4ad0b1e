"""Recently embedded prompts, per tenant, so that one prompt is embedded once, not once per use.

A deterministic request that misses the semantic cache is embedded by its lookup, and again by the
response writer when its answer is stored a moment later: the same normalised text, the same vector,
two MiniLM passes, the second competing with the next requests' lookups. The semantic cache keeps the
last `limit` vectors (384 floats each: 1.5 MB at 1024, ~2 MB with their keys) and embeds only what it
does not hold.

Keyed by tenant and text, never by text alone: a lookup answered without a pass is ~8 ms faster, and a
tenant must not be able to time whether another tenant just asked the same question (the reason the
KV keys and the tokenizer's prefix cache are salted by tenant too).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass

import numpy as np


@dataclass
class RecentStats:
    reused: int = 0  # vectors answered from memory (a MiniLM pass saved each)
    embedded: int = 0  # vectors computed and kept


class RecentVectors:
    """A bounded LRU of (tenant, normalised text) -> unit vector; thread-safe (lookup threads and the
    response writer share it)."""

    def __init__(self, limit: int = 1024):
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self.limit = limit
        self.stats = RecentStats()
        self._vectors: OrderedDict[tuple[str, str], np.ndarray] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, tenant: str, text: str) -> np.ndarray | None:
        with self._lock:
            vec = self._vectors.get((tenant, text))
            if vec is not None:
                self._vectors.move_to_end((tenant, text))
                self.stats.reused += 1
            return vec

    def put(self, tenant: str, text: str, vec: np.ndarray) -> None:
        with self._lock:
            self._vectors[(tenant, text)] = vec
            self._vectors.move_to_end((tenant, text))
            self.stats.embedded += 1
            while len(self._vectors) > self.limit:
                self._vectors.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._vectors.clear()

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return asdict(self.stats)
