"""Engine lifecycle edges found by a review: a preempted request that never resumes, a cancelled queue
head that preempts, shutdown's failures left uncounted, and a TTFT measured across a wall-clock step."""

from __future__ import annotations

import time
from dataclasses import replace

from engine.engine import Engine
from engine.model_runner import ModelRunner
from engine.observer import EngineObserver
from scheduler.preemption import PreemptionPolicy
from scheduler.tiers import TierTable
from tests.test_engine_batching import (
    BUCKETS,
    EOS,
    RecordingSink,
    make_engine,
    model,  # noqa: F401
    request,
    run_until_idle,
)  # noqa: F401
from tests.test_preemption import FAR, critical_request

# critical due at once (it preempts), batch allowed 100 ms in the queue
TIERS = TierTable(
    tuple(
        replace(t, ttft_target_ms=1.0)
        if t.name == "critical"
        else replace(t, max_queue_ms=100.0)
        if t.name == "batch"
        else t
        for t in TierTable.defaults().tiers
    )
)


class FinishRecorder(EngineObserver):
    def __init__(self) -> None:
        self.finished: list[str] = []
        self.ttfts: list[float] = []

    def on_finish(self, tier: str, status: str, tokens: int) -> None:
        self.finished.append(status)

    def on_first_token(self, tier: str, ttft_s: float) -> None:
        self.ttfts.append(ttft_s)


def preempting_engine(model) -> Engine:  # noqa: F811
    runner = ModelRunner(model, slots=1, max_len=128, kv_buckets=BUCKETS)
    return Engine(
        runner, lambda t: bytes([97 + t % 26]), {EOS}, BUCKETS, preemption=PreemptionPolicy(), tiers=TIERS
    )


def running_batch(engine: Engine, max_tokens: int) -> RecordingSink:
    sink = RecordingSink()
    engine.submit(
        request([1, 5, 6], sink, rid="batch", priority=4, tier="batch", deadline=FAR, max_tokens=max_tokens)
    )
    for _ in range(3):
        engine.step()
    return sink


def test_a_preempted_request_that_cannot_resume_ends_with_an_error_instead_of_waiting_forever(model):  # noqa: F811
    """A suspended request never expired, and aging never lifts it above the critical tier: under a steady
    stream of critical requests it got neither tokens nor an error."""
    engine = preempting_engine(model)
    batch = running_batch(engine, max_tokens=60)
    began, n = time.monotonic(), 0
    while time.monotonic() - began < 3.0 and not batch.finished:
        if engine.load()[0] <= 1:  # one critical request waiting at all times
            n += 1
            sink = RecordingSink()
            engine.submit(
                request(
                    [1, 7, 8],
                    sink,
                    rid=f"c{n}",
                    priority=1,
                    tier="critical",
                    deadline=time.time_ns(),
                    max_tokens=2,
                )
            )
        engine.step()
    assert engine.stats.preemptions >= 1 and batch.finished
    assert batch.errors and batch.errors[0][0] == "UNAVAILABLE" and "preempted" in batch.errors[0][1]
    assert engine.stats.finished.get("expired") == 1


def test_a_cancelled_queue_head_preempts_nobody(model):  # noqa: F811
    engine = preempting_engine(model)
    batch = running_batch(engine, max_tokens=30)
    critical = RecordingSink()
    critical.cancel = True  # its client gave up while it was queued
    engine.submit(critical_request(critical))
    run_until_idle(engine)
    assert critical.errors and critical.errors[0][0] == "CANCELLED"
    assert engine.stats.preemptions == 0 and batch.finished and not batch.errors


def test_shutdown_counts_every_request_it_fails(model):  # noqa: F811
    engine = make_engine(model, slots=1)
    engine.observer = observer = FinishRecorder()
    running, queued = RecordingSink(), RecordingSink()
    engine.submit(request([1, 2], running, rid="a", max_tokens=100))
    engine.step()
    engine.submit(request([1, 3], queued, rid="b", max_tokens=3))
    engine.shutdown(drain_timeout_s=0)
    assert running.errors and queued.errors
    assert engine.stats.finished == {"error": 2} and observer.finished == ["error", "error"]


def test_a_wall_clock_step_back_never_reports_a_negative_ttft(model, monkeypatch):  # noqa: F811
    """TTFT goes into a counter's sum, which must never decrease, and into the feedback windows."""
    engine = make_engine(model, slots=1)
    engine.observer = observer = FinishRecorder()
    sink = RecordingSink()
    engine.submit(request([1, 2], sink, rid="a", max_tokens=2))
    real = time.time_ns
    monkeypatch.setattr(time, "time_ns", lambda: real() - 5_000_000_000)
    run_until_idle(engine)
    assert sink.finished and not sink.errors and observer.ttfts == [0.0]
