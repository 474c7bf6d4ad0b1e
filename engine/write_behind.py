"""A bounded write-behind queue: the engine thread hands work off and never waits on Redis."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")
STOP_POLL_S = 0.05  # how often a closed writer whose stop entry found no room looks for what is left


class WriteBehind(Generic[T]):
    def __init__(self, write: Callable[[T], None], name: str, backlog: int = 256):
        self._write = write
        self._items: queue.Queue[tuple[T] | None] = queue.Queue(maxsize=backlog)
        self._closed = False
        self._lock = threading.Lock()  # `submit` against `close`: nothing lands behind the stop entry
        self.dropped = 0
        self.failed = 0  # writes that raised: skipped, the writer carries on
        self.last_error: str | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, item: T) -> bool:
        """Queue `item`; when the writer has fallen behind, or has been closed (a hit's renewal answered
        during a shutdown), drop it (and count it) rather than wait."""
        with self._lock:
            if not self._closed:
                try:
                    self._items.put_nowait((item,))
                    return True
                except queue.Full:
                    pass
            self.dropped += 1
            return False

    def drain(self, timeout_s: float = 10.0) -> bool:
        """Wait until every item queued so far is written (or failed); False if `timeout_s` passed first."""
        deadline = time.monotonic() + timeout_s
        with self._items.all_tasks_done:
            while self._items.unfinished_tasks:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._items.all_tasks_done.wait(left)
        return True

    def close(self, timeout_s: float = 10.0) -> None:
        """Finish what is queued, then stop; waits at most `timeout_s` (a writer stuck on a slow Redis must
        not hold the engine's shutdown: the thread is a daemon). A writer it gave up on still writes what
        is queued when its stuck write returns, then stops; nothing is counted dropped that gets written.
        A second call does nothing."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        deadline = time.monotonic() + timeout_s  # one bound for both waits, not one each
        try:
            self._items.put(None, timeout=timeout_s)
        except queue.Full:  # the writer stops on its own once it has emptied the queue
            return
        self._thread.join(timeout=max(0.0, deadline - time.monotonic()))

    def _run(self) -> None:
        while True:
            try:  # closed with the queue too full for the stop entry: stop once nothing is left
                entry = self._items.get(timeout=STOP_POLL_S if self._closed else None)
            except queue.Empty:
                return
            try:
                if entry is None:  # the stop entry, done too: a drain after close does not wait for it
                    return
                self._write(entry[0])
            except Exception as exc:  # one bad item must not end the thread: every later write would drop
                self.failed += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
            finally:
                self._items.task_done()
