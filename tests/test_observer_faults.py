"""What an observer (the metrics) raises never reaches a request or the engine loop (found by a review):
it failed every running request as a broken step, raised out of `submit` after an exact-cache answer had
been sent, and, raised again while the loop failed those requests, ended the engine thread."""

from __future__ import annotations

import time
import types

from engine.observer import EngineObserver
from engine.response_tier import ResponseLookup
from tests.test_engine_batching import RecordingSink, make_engine, model, request  # noqa: F401


class BrokenLoad(EngineObserver):
    def on_load(self, queued, active, kv_tokens):
        raise RuntimeError("metric message failed")


class BrokenMetrics(EngineObserver):
    """Every callback raises, as when the backend's message queue is broken."""

    def __getattribute__(self, name):
        if name.startswith("on_"):

            def boom(*a, **k):
                raise RuntimeError("metric message failed")

            return boom
        return object.__getattribute__(self, name)


class BrokenLoadAndFinish(BrokenLoad):
    def on_finish(self, tier, status, tokens):
        raise RuntimeError("metric message failed")


def wait(pred, t=20.0):
    end = time.monotonic() + t
    while time.monotonic() < end and not pred():
        time.sleep(0.02)
    return pred()


def test_a_failing_gauge_update_does_not_fail_running_requests(model):  # noqa: F811
    engine = make_engine(model, slots=2)
    engine.observer = BrokenLoad()
    sink = RecordingSink()
    engine.submit(request([1, 2, 3], sink, rid="a", max_tokens=4))
    engine.start()
    try:
        wait(lambda: sink.errors or (sink.windows and sink.windows[-1][2]))
        assert not sink.errors, f"a metrics failure failed the request: {sink.errors}"
    finally:
        engine.shutdown(drain_timeout_s=0)


def test_a_failing_observer_does_not_kill_the_engine_thread(model):  # noqa: F811
    engine = make_engine(model, slots=2)
    engine.observer = BrokenLoadAndFinish()
    first = RecordingSink()
    engine.submit(request([1, 2, 3], first, rid="a", max_tokens=4))
    engine.start()
    try:
        wait(
            lambda: first.errors or (first.windows and first.windows[-1][2]) or not engine._thread.is_alive()
        )
        time.sleep(0.3)
        assert engine._thread.is_alive(), "the engine thread died: every later request waits forever"
        later = RecordingSink()
        engine.submit(request([4, 5], later, rid="b", max_tokens=2))
        assert wait(lambda: later.errors or (later.windows and later.windows[-1][2]), 3.0), "b never answered"
    finally:
        engine._stopping = True


def test_a_metric_failure_after_an_exact_cache_answer_does_not_raise_to_execute(model):  # noqa: F811
    """submit's caller (llm_engine execute) turns an exception into sink.fail after the final response."""
    engine = make_engine(model, slots=1)
    engine.observer = BrokenMetrics()
    engine.responses = types.SimpleNamespace(
        asks_semantic=lambda params: False,
        lookup=lambda *a, **k: ResponseLookup(tokens=[5, 6], key=None),
    )
    sink = RecordingSink()
    engine.submit(request([1, 2], sink, rid="c", max_tokens=4, cache="use"))  # raises today
    assert sink.windows and sink.windows[-1][2] and not sink.errors
