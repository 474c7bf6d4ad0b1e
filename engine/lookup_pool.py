"""Runs slow response-cache lookups (the semantic cache) off the thread that submits requests.

`Engine.submit` runs on the Python backend's execute thread, one request after another. A semantic lookup
embeds the prompt and may run the pair classifier (~11 ms on the CPU VM), so inline it held up every
request that arrived behind it, whatever their own cache settings: a burst of eight waited up to eight
lookups before the last was even queued. Here they run on threads of their own and the submit returns at
once. (More threads overlap the lookups' Redis and Python parts, and their embed calls share MiniLM
passes, cache/embed_coalescer.py; the pair classifier runs one pass at a time.) Waiting lookups are taken
most urgent first (the request's priority, then arrival), so a critical request does not wait behind a
burst of standard ones. Past `max_pending`, a lookup runs on the caller again: the back-pressure the
inline path had, instead of an unbounded backlog. `on_change` is told whenever the number waiting
changes, so that what a drain watches (the engine's queue depth) counts them.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable

_STOP = None
_LAST = 1 << 62  # a priority after every request's: the workers' stop entries


class LookupPool:
    def __init__(self, workers: int = 1, max_pending: int = 64, on_change: Callable[[], None] = lambda: None):
        if workers < 1 or max_pending < 1:
            raise ValueError(f"workers and max_pending must be >= 1, got {workers}, {max_pending}")
        self.max_pending = max_pending
        self._tasks: queue.PriorityQueue[tuple[int, int, Callable[[], None] | None]] = queue.PriorityQueue()
        self._order = itertools.count()
        self._lock = threading.Lock()
        self._pending = 0
        self._closed = False
        self.inline = 0  # lookups run on the caller because the pool was full (or shut down)
        self.failed = 0  # tasks that raised (a bug: tasks report errors to their request)
        self._on_change = on_change
        self._threads = [
            threading.Thread(target=self._work, name=f"response-lookup-{i}", daemon=True)
            for i in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    @property
    def pending(self) -> int:
        with self._lock:
            return self._pending

    def run(self, task: Callable[[], None], priority: int = 0) -> None:
        """`task` on a pool thread (lower `priority` first, then first come), or on this one when
        `max_pending` are waiting already or the pool is shut down. `task` must report its own errors
        (the request's sink): nothing is raised from a pool thread."""
        with self._lock:
            queued = not self._closed and self._pending < self.max_pending
            if queued:
                self._pending += 1
                self._tasks.put((priority, next(self._order), task))
            else:
                self.inline += 1
        if not queued:
            task()
            return
        self._on_change()

    def _work(self) -> None:
        while (task := self._tasks.get()[2]) is not _STOP:
            try:
                task()
            except Exception:  # a task reports its own errors; one that raised anyway must not stop the pool
                self.failed += 1
            finally:
                with self._lock:
                    self._pending -= 1
                self._on_change()

    def shutdown(self) -> None:
        """Waits for the lookups under way and queued: each ends by answering or queueing its request."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for _ in self._threads:  # after every task queued so far: the stop entries sort last
                self._tasks.put((_LAST, next(self._order), _STOP))
        for thread in self._threads:
            thread.join()
