"""llm_engine takes `priority` from its input tensor, which any client may set (Triton serves the model
directly). Engine._bound_precedence keeps it no higher than the tier's, but any lower precedence is kept
as sent, and the engine's queue keeps one bucket (and fair-share counters) per distinct priority for
good: every admission then scans them all. A client that sends direct requests with distinct priorities
(2**31 values) grows the engine's state without bound and slows every later request's admission."""

from __future__ import annotations

import time

from tests.test_engine_batching import RecordingSink, make_engine, model, request, run_until_idle  # noqa: F401


def test_direct_requests_with_distinct_priorities_leave_no_state_behind(model):  # noqa: F811
    engine = make_engine(model)
    for i in range(300):
        sink = RecordingSink()
        now = time.time_ns()
        engine.submit(request([1, 5, 6], sink, rid=f"p{i}", priority=10 + i, max_tokens=1, arrival_ns=now))
        run_until_idle(engine)
        assert sink.finished and not sink.errors
    queue = engine.policy_queue.queue
    assert len(queue._buckets) <= len(engine.tiers), sorted(queue._buckets)[:8]


def test_a_lower_precedence_than_the_tier_s_still_orders_after_it(model):  # noqa: F811
    """What the bound must keep: a request may give up precedence, down to the lowest tier's level."""
    engine = make_engine(model)
    sink = RecordingSink()
    req = request([1, 5, 6], sink, rid="low", priority=2**31 - 1, max_tokens=1)
    engine.submit(req)
    assert req.priority >= engine.tiers.get("standard").priority
    run_until_idle(engine)
    assert sink.finished and not sink.errors
