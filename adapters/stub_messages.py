"""One lock per Python-backend process for the messages its threads send to the server.

The engine's process updates metrics and logs from several threads (the engine loop, Triton's execute
thread for cache hits, the SLO feedback thread, the cache writers). The Python backend this project
ships with (Triton 2.51) crashed the whole server under concurrent metric messages from one stub: a
segfault or `boost::interprocess::lock_exception` in the server's `ProcessMetricRequest`. At 120
requests/s of mostly exact-cache hits on the CPU VM, 3 of 19 fresh servers crashed in their first 600
requests; with every metric message under this lock, none of 20 did. Logs and cancellation checks go
through the same message queue, so they take the lock too. A message is an IPC round trip of tens of
microseconds, so waiting for another thread's costs about as much.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


class SerializedMetric:
    """A pb_utils Metric whose operations hold the process's message lock."""

    def __init__(self, metric, lock: threading.Lock):
        self._metric = metric
        self._lock = lock

    def increment(self, value: float) -> None:
        with self._lock:
            self._metric.increment(value)

    def set(self, value: float) -> None:
        with self._lock:
            self._metric.set(value)

    def observe(self, value: float) -> None:
        with self._lock:
            self._metric.observe(value)


def serialized(send: Callable[..., T], lock: threading.Lock) -> Callable[..., T]:
    """`send` (a request's is_cancelled, say) under the process's message lock."""

    def send_locked(*args) -> T:
        with lock:
            return send(*args)

    return send_locked


RELAYS = frozenset({"triton_common.py", "observer.py"})  # modules whose log calls relay another's line


def serialized_log(log: Callable[[str], None], lock: threading.Lock) -> Callable[[str], None]:
    """A pb_utils.Logger method under the lock. The server's log names the Python frame that called the
    logger, which is now this wrapper, so the line carries its caller's file and line itself."""

    def log_locked(message: str) -> None:
        caller = sys._getframe(1)
        while caller.f_back is not None and Path(caller.f_code.co_filename).name in RELAYS:
            caller = caller.f_back  # log_event and the like pass a line on: name who wrote it
        where = f"{Path(caller.f_code.co_filename).name}:{caller.f_lineno}"
        with lock:
            log(f"[{where}] {message}")

    return log_locked
