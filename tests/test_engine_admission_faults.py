"""The engine's admission against a throttled cancel check and a drain (found in review, 2026-12-07): a
queue head seen cancelled once is ended, never started or left unanswered, and a request taken off the
queue but not yet running counts as work for a drain."""

from __future__ import annotations

import threading

from tests.conftest import wait_for
from engine.cancel_poll import PollSchedule, ThrottledCancelCheck
from tests.test_engine_batching import RecordingSink, make_engine, model, request  # noqa: F401


class ThrottledSink(RecordingSink):
    """Cancels as the Triton adapter's TritonSink does: `cancelled()` asks through a ThrottledCancelCheck,
    which answers a real ask at most once per interval (False in between)."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        schedule = PollSchedule(interval_s=0.25, clock=lambda: self.now)
        self.check = ThrottledCancelCheck(lambda: self.cancel, schedule, "key")

    def cancelled(self) -> bool:
        return self.check()


def test_a_cancelled_queue_head_seen_once_by_a_throttled_check_fails_nobody_and_ends(model):  # noqa: F811
    engine = make_engine(model, slots=1)
    engine.start()
    try:
        running = RecordingSink()
        engine.submit(request([1, 2, 3], running, rid="run", max_tokens=100))
        assert wait_for(lambda: running.windows, 30)
        gone = ThrottledSink()
        gone.cancel, gone.now = True, 1.0  # its client cancelled while it was queued; an ask is due
        engine.submit(request([1, 4, 5], gone, rid="gone", max_tokens=4))
        wait_for(lambda: gone.finished or running.finished, 30)
        assert not running.errors, f"the running request was failed: {running.errors}"
        assert wait_for(lambda: gone.finished, 10), "the cancelled request never got an answer"
    finally:
        engine.shutdown(drain_timeout_s=0)


class SlowStartSink(RecordingSink):
    """A sink whose second `cancelled()` (the engine asks once in the queue, once after popping the head)
    waits until the engine is stopping: it stands for the engine thread being descheduled (or a slow
    is_cancelled IPC) between taking a request off the queue and putting it in a slot. A correct drain
    never sets `_stopping` while that request runs, so the wait times out and the request completes."""

    def __init__(self, engine) -> None:
        super().__init__()
        self.engine, self.asks, self.popped = engine, 0, threading.Event()

    def cancelled(self) -> bool:
        self.asks += 1
        if self.asks == 2:
            self.popped.set()
            wait_for(lambda: self.engine._stopping, 3)
        return False


def test_shutdown_drains_a_request_taken_off_the_queue_but_not_yet_in_a_slot(model):  # noqa: F811
    engine = make_engine(model, slots=1)
    engine.start()
    sink = SlowStartSink(engine)
    engine.submit(request([1, 2, 3], sink, rid="a", max_tokens=6))
    assert sink.popped.wait(30)
    engine.shutdown(drain_timeout_s=30)  # 30 s: every accepted request should finish
    assert not sink.errors, f"an accepted request was failed by a drain with 27 s left: {sink.errors}"
    assert len(sink.tokens) == 6


def test_a_cancelled_queue_head_seen_once_by_a_throttled_check_is_answered_not_lost(model):  # noqa: F811
    engine = make_engine(model, slots=1)
    engine.start()
    try:
        gone = ThrottledSink()
        gone.cancel, gone.now = True, 1.0
        engine.submit(request([1, 4, 5], gone, rid="gone", max_tokens=4))
        assert wait_for(lambda: gone.finished, 10), (
            f"no answer at all (step failures: {engine.stats.step_failures}, load {engine.load()})"
        )
    finally:
        engine.shutdown(drain_timeout_s=0)
