"""Recently embedded texts, so that one prompt is embedded once, not once per use.

A deterministic request that misses the semantic cache is embedded by its lookup, and again by the
response writer when its answer is stored a moment later: the same normalised text, the same vector,
two MiniLM passes, the second competing with the next requests' lookups. This wrapper keeps the last
`limit` texts' vectors (384 floats each: 1.5 MB at 1024) and embeds only the texts it does not hold.
A vector is a pure function of its text and the weights, which one wrapper never changes, so a held
vector is the one a pass would give (up to the float noise of another batch's padding).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass

import numpy as np

from cache.embed_coalescer import BatchEmbedder


@dataclass
class MemoStats:
    reused: int = 0  # texts answered from the memo (a pass saved each)
    embedded: int = 0  # texts passed to the inner embedder


class RecentEmbeddings:
    """An ``Embedder`` over another that reuses the vectors of its last ``limit`` texts."""

    def __init__(self, inner: BatchEmbedder, limit: int = 1024):
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self.inner = inner
        self.dim = int(inner.dim)
        self.limit = limit
        self.stats = MemoStats()
        self._vectors: OrderedDict[str, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()

    def embed(self, texts: list[str] | tuple[str, ...]) -> np.ndarray:
        texts = list(texts)
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        missing: dict[str, list[int]] = {}
        with self._lock:
            for i, text in enumerate(texts):
                if (vec := self._vectors.get(text)) is not None:
                    self._vectors.move_to_end(text)
                    out[i] = vec
                else:
                    missing.setdefault(text, []).append(i)
            self.stats.reused += len(texts) - sum(map(len, missing.values()))
            self.stats.embedded += len(missing)
        if not missing:
            return out
        rows = np.asarray(self.inner.embed(list(missing)), dtype=np.float32)  # raises before anything is kept
        if rows.shape != (len(missing), self.dim):
            raise ValueError(f"the embedder gave {rows.shape} for {len(missing)} texts of dim {self.dim}")
        with self._lock:
            for row, (text, where) in zip(rows, missing.items()):
                out[where] = row
                self._vectors[text] = row.copy()
                self._vectors.move_to_end(text)
            while len(self._vectors) > self.limit:
                self._vectors.popitem(last=False)
        return out

    def fits(self, texts: list[str] | tuple[str, ...]) -> list[bool]:
        return self.inner.fits(list(texts))

    def snapshot(self) -> dict[str, int]:
        """Its counters and the inner embedder's, for metrics (the semantic cache reports them as
        ``embed_<name>``)."""
        with self._lock:
            counters = {f"memo_{name}": value for name, value in asdict(self.stats).items()}
        inner = getattr(self.inner, "snapshot", None)
        return {**(inner() if callable(inner) else {}), **counters}
