"""What an observer (the metrics) raises never reaches a request or the engine loop (found by a review):
it failed every running request as a broken step, raised out of `submit` after an exact-cache answer had
been sent, and, raised again while the loop failed those requests, ended the engine thread."""

from __future__ import annotations

import types

from engine.engine import Engine
from engine.observer import EngineObserver
from engine.response_tier import ResponseLookup
from tests.conftest import wait_for
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


def answered(sink: RecordingSink) -> bool:
    return bool(sink.errors) or bool(sink.windows and sink.windows[-1][2])


def serving(model, observer: EngineObserver) -> tuple[Engine, RecordingSink]:  # noqa: F811
    """A started engine whose observer raises, with one request submitted."""
    engine = make_engine(model, slots=2)
    engine.observer = observer
    sink = RecordingSink()
    engine.submit(request([1, 2, 3], sink, rid="a", max_tokens=4))
    engine.start()
    return engine, sink


def test_a_failing_gauge_update_does_not_fail_running_requests(model):  # noqa: F811
    engine, sink = serving(model, BrokenLoad())
    try:
        assert wait_for(lambda: answered(sink), 20)
        assert not sink.errors, f"a metrics failure failed the request: {sink.errors}"
        assert engine.observer.failures > 0
    finally:
        engine.shutdown(drain_timeout_s=0)


def test_a_failing_observer_does_not_kill_the_engine_thread(model):  # noqa: F811
    engine, first = serving(model, BrokenLoadAndFinish())
    try:
        assert wait_for(lambda: answered(first), 20)
        assert engine._thread.is_alive(), "the engine thread died: every later request waits forever"
        later = RecordingSink()
        engine.submit(request([4, 5], later, rid="b", max_tokens=2))
        assert wait_for(lambda: answered(later), 10), "b never answered"
        assert not first.errors and not later.errors
    finally:
        engine.shutdown(drain_timeout_s=0)


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
