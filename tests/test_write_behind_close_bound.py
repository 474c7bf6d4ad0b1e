"""`WriteBehind.close(timeout_s)` promises to wait "at most `timeout_s`" (a writer stuck on a slow Redis
must not hold the engine's shutdown). With a full queue it waits up to `timeout_s` for room for its stop
entry, then up to `timeout_s` again for the thread: nearly twice the bound when room opens late."""

from __future__ import annotations

import threading
import time

from engine.write_behind import WriteBehind


def test_close_waits_at_most_its_timeout_when_room_opens_late():
    first, release_first, release_rest = threading.Event(), threading.Event(), threading.Event()

    def write(item: int) -> None:
        if item == 0:
            first.set()
            release_first.wait(30)
        else:
            release_rest.wait(30)  # Redis still slow: the next write is stuck too

    writes = WriteBehind(write, "slow-writer", backlog=1)
    try:
        assert writes.submit(0) and first.wait(5)
        assert writes.submit(1)  # the queue is full
        threading.Timer(0.7, release_first.set).start()  # room for the stop entry opens late
        began = time.monotonic()
        writes.close(timeout_s=1.0)
        took = time.monotonic() - began
        assert took < 1.3, f"close(timeout_s=1.0) waited {took:.2f} s"
    finally:
        release_first.set()
        release_rest.set()
