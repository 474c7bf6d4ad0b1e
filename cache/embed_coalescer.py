"""Group-commit embedding: concurrent ``embed`` calls share one forward pass.

Semantic lookups run on several threads (engine/lookup_pool.py) and each embeds one short prompt, but
the embedder runs one forward pass at a time: a burst of N lookups paid N single-text passes in a row,
when a batched pass costs far less per text (MiniLM on the 2-core CPU VM: ~2.7 ms a text in a batch).
So a caller that finds no pass under way runs its own at once (no timer: a lone lookup never waits for
company); callers that arrive during a pass queue their texts, and when it ends one of them, the leader,
runs one pass for everything queued (first come first, up to ``max_texts``) and hands each caller its
own rows. A pass that raises an Exception raises `EmbeddingFailed` in each of its callers, a fresh one
each chained to it (one object raised in several threads would gather all their frames in its
traceback); an interrupt (KeyboardInterrupt, SystemExit) stays in the thread it was raised in, and the
pass's other callers get `EmbeddingFailed`. Either way every caller is answered and the next pass runs.

A batch pads to its longest text. MiniLM masks the padding, so a text's vector alone or in a batch
differs by float noise only (tests/test_embed_coalescer.py checks it on the real checkpoint).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import asdict, dataclass
from typing import Protocol

import numpy as np


class BatchEmbedder(Protocol):
    dim: int

    def embed(self, texts: list[str]) -> np.ndarray: ...

    def fits(self, texts: list[str]) -> list[bool]: ...


@dataclass(frozen=True)
class CoalescerConfig:
    # texts one coalesced pass takes at most: MiniLMEmbedder's batch_size, past which it would split the
    # pass anyway. A single call with more texts still runs whole (the inner embedder splits it).
    max_texts: int = 64
    # what a pass computes, for its errors (the pair classifier shares this group commit: "pair scoring")
    what: str = "embedding"
    # the rows' dtype: float32 vectors; the pair classifier's float64 probabilities keep their precision,
    # so a shared pass decides at a cut exactly as the classifier alone does
    dtype: type = np.float32


class EmbeddingFailed(RuntimeError):
    """The shared pass that was to embed this caller's texts failed (its error is the ``__cause__``)."""


@dataclass
class CoalescerStats:
    calls: int = 0  # embed calls with at least one text
    queued: int = 0  # of them, those that arrived during a pass and waited for a later one
    passes: int = 0  # calls of the inner embedder: texts / passes is the mean batch
    texts: int = 0
    errors: int = 0  # passes that raised (in every one of their callers)


class _Call:
    """One caller's texts and, once its pass ends, its rows or the pass's error."""

    __slots__ = ("texts", "rows", "error", "done")

    def __init__(self, texts: list[str]):
        self.texts = texts
        self.rows: np.ndarray | None = None
        self.error: BaseException | None = None
        self.done = False


class CoalescingEmbedder:
    """An ``Embedder`` (``embed``, ``fits``, ``dim``) over another whose concurrent ``embed`` calls
    coalesce into one pass of the inner embedder; ``fits`` goes straight to it."""

    def __init__(self, inner: BatchEmbedder, config: CoalescerConfig | None = None):
        self.config = config or CoalescerConfig()
        if self.config.max_texts < 1:
            raise ValueError(f"max_texts must be >= 1, got {self.config.max_texts}")
        self.inner = inner
        self.dim = int(inner.dim)
        self.stats = CoalescerStats()
        self._cond = threading.Condition()
        self._queue: deque[_Call] = deque()
        self._running = False

    def embed(self, texts: list[str] | tuple[str, ...]) -> np.ndarray:
        """(len(texts), dim) in the config's dtype: this call's rows, in order, of the pass that made them."""
        call = _Call(list(texts))
        if not call.texts:
            return np.zeros((0, self.dim), dtype=self.config.dtype)
        with self._cond:
            self.stats.calls += 1
            self.stats.queued += self._running
            self._queue.append(call)
        while self._lead_once(call):
            pass
        if call.error is not None:
            # neither the call nor this frame may keep the error: its traceback holds the failed pass's
            # frames, whose f_back chain reaches back here, and a cycle would keep them until a GC
            error, call.error = call.error, None
            try:
                raise EmbeddingFailed(f"the {self.config.what} pass failed: {error!r}") from error
            finally:
                del error
        assert call.rows is not None
        return call.rows

    def fits(self, texts: list[str] | tuple[str, ...]) -> list[bool]:
        return self.inner.fits(list(texts))

    @property
    def identity(self) -> str | None:
        """The inner embedder's (its vectors are the inner one's): what the semantic cache keys by."""
        return getattr(self.inner, "identity", None)

    def snapshot(self) -> dict[str, int]:
        """The cumulative counters, for metrics (the semantic cache reports them as ``embed_<name>``)."""
        with self._cond:
            return asdict(self.stats)

    @property
    def waiting(self) -> int:
        """Callers queued for the next pass."""
        with self._cond:
            return len(self._queue)

    def _lead_once(self, call: _Call) -> bool:
        """Wait until ``call`` is answered (False) or no pass runs; then take the lead: one pass for every
        queued call (first come first, up to ``max_texts``), and True. While no pass runs every unanswered
        call is queued, so the batch is never empty; it may leave out ``call`` itself when those ahead of
        it fill ``max_texts``: the leader then loops, as waiter or leader again. From the moment a call
        leaves the queue to its answer, everything is inside one try, so an interrupt anywhere in between
        (KeyboardInterrupt in the execute thread) still answers the batch and frees the next pass."""
        batch: list[_Call] = []
        rows: np.ndarray | None = None
        error: BaseException | None = None
        led = False  # whether this thread marked a pass running (so its answer unmarks it)
        try:
            with self._cond:
                while self._running and not call.done:
                    self._cond.wait()
                if call.done:
                    return False
                n = 0
                while self._queue and (not batch or n + len(self._queue[0].texts) <= self.config.max_texts):
                    batch.append(self._queue[0])  # listed before it leaves the queue: never lost between
                    self._queue.popleft()
                    n += len(batch[-1].texts)
                led = True  # before the mark: unmarking a pass not marked is harmless, the reverse wedges
                self._running = True
            texts = [text for c in batch for text in c.texts]
            rows = np.asarray(self.inner.embed(texts), dtype=self.config.dtype)
            if rows.shape != (len(texts), self.dim):
                raise ValueError(f"the embedder gave {rows.shape} for {len(texts)} texts of dim {self.dim}")
        except Exception as exc:  # handed to every caller of this pass
            rows, error = None, exc
        finally:  # on an interrupt too (rows None and no error): the interrupt goes on from here only
            try:
                if batch:
                    self._answer(batch, rows, error, led)
            finally:
                error = None  # this frame, which the error's traceback holds, must not hold the error
        return True

    def _answer(
        self, batch: list[_Call], rows: np.ndarray | None, error: BaseException | None, led: bool = True
    ) -> None:
        with self._cond:
            try:
                if rows is None and error is None:
                    error = RuntimeError(f"the {self.config.what} pass was interrupted in another thread")
                start = 0
                for c in batch:
                    if error is None:
                        c.rows = rows[start : start + len(c.texts)]
                        start += len(c.texts)
                    else:
                        c.error = error
                    c.done = True
                self.stats.passes += 1
                self.stats.texts += sum(len(c.texts) for c in batch)
                self.stats.errors += error is not None
            finally:  # interrupted while answering: the rest are told, and the next pass may start
                for c in batch:
                    if not c.done:
                        c.error, c.done = RuntimeError(f"the {self.config.what} pass was interrupted"), True
                if led:
                    self._running = False
                self._cond.notify_all()
