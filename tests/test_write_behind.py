"""The write-behind queue outlives a write that raises, and its close never hangs the shutdown."""

from __future__ import annotations

import threading
import time

from engine.write_behind import WriteBehind
from tests.conftest import wait_for


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


def stuck_writer(backlog: int) -> tuple[WriteBehind[int], list[int], threading.Event]:
    """A writer stuck on its first item (a slow Redis) until the event returned is set."""
    writing, release = threading.Event(), threading.Event()
    written: list[int] = []

    def write(item: int) -> None:
        if item == 0:
            writing.set()
            release.wait(30)
        written.append(item)

    writes = WriteBehind(write, "stuck-writer", backlog=backlog)
    assert writes.submit(0) and writing.wait(5)
    return writes, written, release


def test_a_close_that_gives_up_counts_nothing_dropped_that_is_then_written():
    """Queue not full: the stop entry goes in, the join times out; the entries behind the stuck write were
    counted dropped, then written all the same (found in review, 2026-12-07)."""
    writes, written, release = stuck_writer(backlog=8)
    for item in (1, 2, 3):
        assert writes.submit(item)
    writes.close(timeout_s=0.2)
    release.set()
    assert wait_for(lambda: not writes._thread.is_alive(), 10)
    # every item was written, so none may be counted dropped
    assert written == [0, 1, 2, 3]
    assert writes.dropped == 0, f"{writes.dropped} writes counted dropped, yet all were written"


def test_a_close_that_gives_up_on_a_full_queue_still_stops_the_writer():
    """Queue full: no stop entry could be queued; the thread, once its stuck write returned, used to wait on
    the empty queue for good (found in review, 2026-12-07)."""
    writes, written, release = stuck_writer(backlog=2)
    assert writes.submit(1) and writes.submit(2)
    writes.close(timeout_s=0.2)
    release.set()
    assert wait_for(lambda: written == [0, 1, 2], 10)
    assert wait_for(lambda: not writes._thread.is_alive(), 3), "closed writer never stops"


def test_drain_after_a_second_close_does_not_wait_for_a_stop_entry_nobody_reads():
    written: list[int] = []
    writes = WriteBehind(written.append, "twice-closed", backlog=8)
    assert writes.submit(1)
    writes.close()
    writes.close()  # e.g. a shutdown retried: the second stop entry lands after the thread exited
    assert writes.drain(1.0), "drain timed out with nothing pending"
    assert written == [1]
