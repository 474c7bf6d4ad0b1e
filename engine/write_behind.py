"""A bounded write-behind queue: the engine thread hands work off and never waits on Redis."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class WriteBehind(Generic[T]):
    def __init__(self, write: Callable[[T], None], name: str, backlog: int = 256):
        self._write = write
        self._items: queue.Queue[tuple[T] | None] = queue.Queue(maxsize=backlog)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self.dropped = 0

    def submit(self, item: T) -> bool:
        """Queue `item`; when the writer has fallen behind, drop it (and count it) rather than wait."""
        try:
            self._items.put_nowait((item,))
            return True
        except queue.Full:
            self.dropped += 1
            return False

    def close(self) -> None:
        """Finish what is queued, then stop."""
        self._items.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while (entry := self._items.get()) is not None:
            self._write(entry[0])
