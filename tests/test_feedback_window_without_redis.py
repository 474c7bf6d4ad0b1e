"""Without a redis_url (config.pbtxt's default: only the launcher sets one) the SLO feedback loop starts
no thread, so nothing ever takes its latency window; the engine still appended every request's TTFT to it:
one float per request for the process's life. A window must be bounded however long nobody takes it.
(found in review, 2026-12-07)"""

from __future__ import annotations

import pytest

import engine.slo_feedback as slo_feedback
from engine.slo_feedback import SloFeedbackLoop, TierLatencyWindow
from scheduler.feedback import FeedbackController
from tests.test_engine_batching import RecordingSink, make_engine, model, request  # noqa: F401

LIMIT = 50


@pytest.fixture(autouse=True)
def small_bound(monkeypatch):
    monkeypatch.setattr(slo_feedback, "MAX_WINDOW_SAMPLES", LIMIT, raising=False)


def held(window: TierLatencyWindow) -> int:
    return sum(len(samples) for samples in window._samples.values())


def test_an_untaken_window_stays_bounded():
    window = TierLatencyWindow()
    for i in range(1000):
        window.observe("standard", float(i))
    assert held(window) <= LIMIT
    taken = window.take()["standard"]
    assert list(taken)[-1] == 999.0  # the most recent samples are the ones kept


def test_engine_without_redis_keeps_no_growing_window(model):  # noqa: F811
    engine = make_engine(model, slots=2)
    # as engine/loader.py builds it, with config.redis_url at its default ""
    engine.feedback = SloFeedbackLoop(
        "", "m", engine.tiers, FeedbackController(engine.tiers), engine.apply_feedback
    )
    engine.feedback.start()
    try:
        for i in range(200):
            sink = RecordingSink()
            engine.submit(request([1, 5, 7, i % 200 + 3], sink, rid=f"id-{i}", max_tokens=1))
            while engine.step():
                pass
            assert sink.windows and sink.windows[-1][2]
        assert held(engine.feedback.window) <= LIMIT, f"{held(engine.feedback.window)} samples held"
    finally:
        engine.feedback.stop()
