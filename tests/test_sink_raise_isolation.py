"""A response that raises for one request (its sender broke: an IPC failure, a released request) must end
that request alone: the engine loop's catch-all fails every running request instead, and a request whose
sink keeps raising is never removed, so the loop spins on it and nobody else is ever served."""

from __future__ import annotations

from tests.conftest import wait_for
from tests.test_engine_batching import RecordingSink, make_engine, model, request  # noqa: F401


class RaisingSink(RecordingSink):
    """send() raises from its `first` call on (once, or for good when `always`); fail() too when `always`."""

    def __init__(self, first: int, always: bool = False, fail_raises: bool = False) -> None:
        super().__init__()
        self.first, self.always, self.fail_raises, self.calls = first, always, fail_raises, 0

    def send(self, token_ids, read_offset, final, trim_bytes=0):
        self.calls += 1
        if self.calls - 1 == self.first or (self.always and self.calls - 1 > self.first):
            raise RuntimeError("response sender failed")
        super().send(token_ids, read_offset, final, trim_bytes)

    def fail(self, code, message):
        if self.always or self.fail_raises:
            self.fail_raises = self.always  # once unless always
            raise RuntimeError("response sender failed")
        super().fail(code, message)


def finals(sink: RecordingSink) -> int:
    return len(sink.errors) + sum(1 for *_, final in sink.windows if final)


def test_a_send_that_raises_mid_decode_fails_its_own_request_only(model):  # noqa: F811
    engine = make_engine(model, slots=2)
    healthy, broken = RecordingSink(), RaisingSink(first=1)  # its first decode token's send raises
    engine.submit(request([1, 2, 3], healthy, rid="healthy", max_tokens=6))
    engine.submit(request([1, 4, 5], broken, rid="broken", max_tokens=6))
    engine.start()
    try:
        assert wait_for(lambda: healthy.finished and broken.finished, 15)
        assert not healthy.errors, f"a neighbour's failed send failed this request: {healthy.errors}"
        assert len(healthy.tokens) == 6 and finals(healthy) == 1
        assert finals(broken) == 1 and broken.errors and broken.errors[0][0] == "INTERNAL"
        assert wait_for(lambda: not engine._active and sorted(engine._free) == [0, 1], 5)
    finally:
        engine.shutdown(drain_timeout_s=0)


def test_a_sink_that_keeps_raising_does_not_stop_the_engine_serving_others(model):  # noqa: F811
    engine = make_engine(model, slots=2)
    broken = RaisingSink(first=1, always=True)  # its first token went; every later send and fail raise
    engine.submit(request([1, 4, 5], broken, rid="broken", max_tokens=50))
    engine.start()
    try:
        assert wait_for(lambda: broken.windows, 10)
        probe = RecordingSink()
        engine.submit(request([1, 2, 3], probe, rid="probe", max_tokens=4))
        assert wait_for(lambda: probe.finished, 8), (
            f"the engine never served a later request (step failures: {engine.stats.step_failures})"
        )
        assert not probe.errors and len(probe.tokens) == 4
    finally:
        engine.shutdown(drain_timeout_s=0)


def test_a_cancelled_request_whose_error_raises_fails_nobody_else(model):  # noqa: F811
    engine = make_engine(model, slots=2)
    healthy, gone = RecordingSink(), RaisingSink(first=10**6, fail_raises=True)  # only its first fail raises
    engine.submit(request([1, 2, 3], healthy, rid="healthy", max_tokens=40))
    engine.submit(request([1, 4, 5], gone, rid="gone", max_tokens=40))
    engine.start()
    try:
        assert wait_for(lambda: healthy.windows and gone.windows, 10)
        gone.cancel = True
        assert wait_for(lambda: healthy.finished, 15)
        assert not healthy.errors, f"a cancelled neighbour's failed response failed it: {healthy.errors}"
        assert len(healthy.tokens) == 40
        assert wait_for(lambda: not engine._active, 5)
    finally:
        engine.shutdown(drain_timeout_s=0)


def test_requests_expiring_together_are_all_answered_when_one_error_raises(model):  # noqa: F811
    import time

    from engine.engine import Engine
    from engine.model_runner import ModelRunner
    from tests.test_engine_batching import BUCKETS, EOS, tiers_with_max_queue

    runner = ModelRunner(model, slots=1, max_len=128, kv_buckets=BUCKETS)
    engine = Engine(runner, lambda t: bytes([97 + t % 26]), {EOS}, BUCKETS, tiers=tiers_with_max_queue(300))
    first, second = RaisingSink(first=10**6, fail_raises=True), RecordingSink()  # only first's error raises
    now = time.time_ns()
    engine.submit(request([1, 3], first, rid="first", max_tokens=3, arrival_ns=now - 900_000_000))
    engine.submit(request([1, 4], second, rid="second", max_tokens=3, arrival_ns=now - 800_000_000))
    engine.start()  # both waited past max_queue_ms upstream: the first step ends them together
    try:
        assert wait_for(lambda: second.finished, 8), (
            f"never answered (queued: {len(engine._queue)}, finished: {engine.stats.finished})"
        )
        assert second.errors[0][0] == "UNAVAILABLE" and "max_queue_ms" in second.errors[0][1]
    finally:
        engine.shutdown(drain_timeout_s=0)
