"""A Redis that refuses writes but still answers reads: at `maxmemory` with nothing to evict (policy
`noeviction`, or `volatile-*` with no key left to evict: "OOM command not allowed"), or a read-only
replica (after a failover, or `REPLICAOF`: "READONLY"). Counted as a breaker failure, that refusal would
open the breaker and stop the reads too: every cache hit lost because no write can land. So a refused
write only pauses writes for a moment, and the refusals and the writes skipped meanwhile are counted
(`full_refusals`, `readonly_refusals`, `full_skips`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

FULL_PAUSE_S = 1.0  # writes sent into a full Redis are wasted: an L3 chain is megabytes


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether Redis refused a command for want of memory (redis-py's OutOfMemoryError, or a script's
    error that wraps the same reply)."""
    from redis.exceptions import OutOfMemoryError, ResponseError

    wrapped = isinstance(exc, ResponseError) and "command not allowed when used memory" in str(exc)
    return isinstance(exc, OutOfMemoryError) or wrapped


def is_read_only(exc: BaseException) -> bool:
    """Whether a read-only replica refused a write (redis-py's ReadOnlyError, or a script's error that
    wraps the same reply)."""
    from redis.exceptions import ReadOnlyError, ResponseError

    wrapped = isinstance(exc, ResponseError) and "write against a read only replica" in str(exc)
    return isinstance(exc, ReadOnlyError) or wrapped


class FullGate:
    """Writes may go unless Redis refused one (full, or read-only) within the last `pause_s`."""

    def __init__(self, pause_s: float = FULL_PAUSE_S, clock: Callable[[], float] = time.monotonic):
        self.pause_s = pause_s
        self.clock = clock
        self._until = 0.0
        self._lock = threading.Lock()
        self.refusals = 0  # for memory
        self.readonly_refusals = 0
        self.skips = 0

    def allow(self) -> bool:
        """False (and counted) while writes are paused."""
        with self._lock:
            if self.clock() >= self._until:
                return True
            self.skips += 1
            return False

    def refused(self, exc: BaseException) -> bool:
        """Whether `exc` was Redis refusing a write (for memory, or as a read-only replica); if so writes
        pause. Not a breaker failure: Redis answered and reads still work, so callers report it to their
        breaker as a success."""
        full, read_only = is_out_of_memory(exc), is_read_only(exc)
        if not (full or read_only):
            return False
        with self._lock:
            self.refusals += full
            self.readonly_refusals += read_only and not full
            self._until = self.clock() + self.pause_s
        return True
