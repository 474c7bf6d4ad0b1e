"""The write-behind queue outlives a write that raises, and its close never hangs the shutdown."""

from __future__ import annotations

import threading
import time

from engine.write_behind import WriteBehind


def test_a_write_that_raises_is_counted_and_the_writer_carries_on():
    written: list[int] = []

    def write(item: int) -> None:
        if item == 1:
            raise ValueError("a bad item")
        written.append(item)

    writes = WriteBehind(write, "test-writer", backlog=8)
    for item in range(4):
        assert writes.submit(item)
    writes.close()
    assert written == [0, 2, 3] and writes.failed == 1 and writes.last_error == "ValueError: a bad item"


def test_close_gives_up_on_a_stuck_writer_with_a_full_queue():
    writing, release = threading.Event(), threading.Event()

    def write(item: int) -> None:
        writing.set()
        release.wait(30)

    writes = WriteBehind(write, "stuck-writer", backlog=2)
    assert writes.submit(0) and writing.wait(5)  # the writer holds item 0
    assert writes.submit(1) and writes.submit(2)  # and the queue is full
    assert not writes.submit(99) and writes.dropped == 1
    started = time.monotonic()
    writes.close(timeout_s=0.2)
    assert time.monotonic() - started < 2.0
    release.set()


def test_drain_waits_for_every_item_queued_so_far():
    gate, written = threading.Event(), []
    writer = WriteBehind(lambda item: gate.wait(10) and written.append(item), "drain-test", backlog=8)
    try:
        for item in range(3):
            assert writer.submit(item)
        assert not writer.drain(0.05), "the first write waits for the gate"
        gate.set()
        assert writer.drain(10) and written == [0, 1, 2]
    finally:
        writer.close()


def test_an_item_handed_over_after_close_is_counted_dropped_not_lost():
    """A hit's renewal answered during a shutdown reached a writer that had stopped: neither written nor
    counted, and a drain waited its whole timeout for it."""
    written: list[int] = []
    writer = WriteBehind(written.append, "after-close")
    assert writer.submit(1)
    writer.close()
    assert not writer.submit(2) and writer.dropped == 1
    began = time.monotonic()
    assert writer.drain(1.0) and time.monotonic() - began < 0.5 and written == [1]
