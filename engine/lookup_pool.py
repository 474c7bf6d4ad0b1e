"""Runs slow response-cache lookups (the semantic cache) off the thread that submits requests.

`Engine.submit` runs on the Python backend's execute thread, one request after another. A semantic
lookup embeds the prompt and may run the pair classifier (~11 ms on the CPU VM), so inline it held up
every request that arrived behind it, whatever their own cache settings: a burst of eight waited up to
eight lookups before the last was even queued. Here they run on threads of their own and the submit
returns at once. (A second thread overlaps only the lookups' Redis and Python parts: the embedder and the
pair classifier each run one pass at a time.) Past `max_pending`, a lookup runs on the caller again: the
back-pressure the inline path had, instead of an unbounded backlog. `on_change` is told whenever the
number waiting changes, so that what a drain watches (the engine's queue depth) counts them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor


class LookupPool:
    def __init__(self, workers: int = 1, max_pending: int = 64, on_change: Callable[[], None] = lambda: None):
        if workers < 1 or max_pending < 1:
            raise ValueError(f"workers and max_pending must be >= 1, got {workers}, {max_pending}")
        self.max_pending = max_pending
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="response-lookup")
        self._lock = threading.Lock()
        self._pending = 0
        self.inline = 0  # lookups run on the caller because the pool was full (or shut down)
        self._on_change = on_change

    @property
    def pending(self) -> int:
        with self._lock:
            return self._pending

    def run(self, task: Callable[[], None]) -> None:
        """`task` on a pool thread, or on this one when `max_pending` are waiting already. `task` must
        report its own errors (the request's sink): nothing is raised from a pool thread."""
        with self._lock:
            queued = self._pending < self.max_pending
            if queued:
                self._pending += 1
            else:
                self.inline += 1
        if not queued:
            task()
            return
        try:
            self._executor.submit(self._done_after, task)
        except RuntimeError:  # shut down meanwhile: run it here, where it finds the engine not accepting
            with self._lock:
                self._pending -= 1
                self.inline += 1
            task()
            return
        self._on_change()

    def _done_after(self, task: Callable[[], None]) -> None:
        try:
            task()
        finally:
            with self._lock:
                self._pending -= 1
            self._on_change()

    def shutdown(self) -> None:
        """Waits for the lookups under way and queued: each ends by answering or failing its request."""
        self._executor.shutdown(wait=True)
