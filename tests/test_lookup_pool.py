"""Semantic-cache lookups run off the submitting thread (engine/lookup_pool.py): a slow lookup holds up
neither the submit that started it nor the requests behind it, a hit is still answered from the cache,
and a lookup under way when the engine stops fails its request instead of leaving it waiting. The
semantic cache is stood in for by a gate (the real one is served in tests/test_server_semantic_cache.py)."""

from __future__ import annotations

import threading
import uuid
from types import SimpleNamespace

import pytest

from cache.response_cache import ExactAnswer, ExactResponseCache
from engine.lookup_pool import LookupPool
from scheduler.errors import RequestError
from engine.response_tier import ResponseTier
from tests.conftest import wait_for
from tests.test_engine_batching import RecordingSink, make_engine, model, request  # noqa: F401


class GatedSemantic:
    """A semantic cache whose lookups wait for `gate`; answers `answer` (None: a miss)."""

    def __init__(self, answer: ExactAnswer | None = None):
        self.gate, self.entered = threading.Event(), threading.Event()
        self.answer = answer
        self.looked_up = 0

    def lookup(self, question, tenant, params, variant=""):
        self.looked_up += 1
        self.entered.set()
        assert self.gate.wait(20), "the test never opened the gate"
        return None if self.answer is None else SimpleNamespace(answer=self.answer)

    def store(self, *args, **kwargs):
        pass

    def close(self):
        pass

    def snapshot(self):
        return {}


def gated_engine(model, redis_url, semantic):  # noqa: F811
    engine = make_engine(model, slots=2)
    exact = ExactResponseCache(redis_url, f"fp-{uuid.uuid4().hex[:8]}", timeout_s=0.5)
    engine.responses = ResponseTier(exact, lambda ids, trim: b"x")
    engine.responses.semantic = semantic
    engine.use_lookup_threads(1)
    engine.start()
    return engine


def test_a_slow_lookup_holds_up_neither_its_submit_nor_the_requests_behind_it(model, redis_server):  # noqa: F811
    semantic = GatedSemantic()
    engine = gated_engine(model, redis_server, semantic)
    try:
        greedy, sampled = RecordingSink(), RecordingSink()
        engine.submit(request([1, 5, 6], greedy, "greedy", temperature=0.0, max_tokens=4))  # returns
        assert semantic.entered.wait(10) and not semantic.gate.is_set(), "the lookup runs, gated"
        engine.submit(request([1, 7, 8], sampled, "sampled", temperature=0.7, max_tokens=4))  # no lookup
        assert wait_for(lambda: sampled.finished, 20) and not greedy.finished
        semantic.gate.set()
        assert wait_for(lambda: greedy.finished, 20) and len(greedy.tokens) == 4 and not greedy.errors
        assert engine.stats.finished.get("cached") is None, "a miss is generated"
    finally:
        semantic.gate.set()
        engine.shutdown(1.0)


def test_a_hit_found_off_thread_is_answered_from_the_cache(model, redis_server):  # noqa: F811
    semantic = GatedSemantic(answer=ExactAnswer((2, 0, 1), 0, True))
    semantic.gate.set()
    engine = gated_engine(model, redis_server, semantic)
    try:
        sink = RecordingSink()
        engine.submit(request([1, 5, 6], sink, temperature=0.0, max_tokens=4, stream=True))
        assert wait_for(lambda: sink.finished, 20)
        assert sink.tokens == [2, 0, 1] and engine.stats.finished.get("cached") == 1
    finally:
        engine.shutdown(1.0)


def test_a_request_in_a_lookup_when_shutdown_begins_is_served_in_the_drain(model, redis_server):  # noqa: F811
    """Accepted before the shutdown, as a request queued then; a request submitted after it is refused."""
    semantic = GatedSemantic()
    engine = gated_engine(model, redis_server, semantic)
    sink, late = RecordingSink(), RecordingSink()
    engine.submit(request([1, 5, 6], sink, temperature=0.0))
    assert semantic.entered.wait(10)
    assert engine.load() == (1, 0), "a request in a lookup counts as waiting: a drain sees it"
    stopping = threading.Thread(target=engine.shutdown, args=(10.0,))
    stopping.start()
    assert wait_for(lambda: not engine._accepting, 10)
    with pytest.raises(RequestError, match="shutting down"):
        engine.submit(request([1, 9, 9], late, temperature=0.7))
    semantic.gate.set()
    stopping.join(30)
    assert not stopping.is_alive() and sink.finished and not sink.errors and len(sink.tokens) == 8


def test_warmup_requests_look_up_inline(model, redis_server):  # noqa: F811
    """Warmup steps the engine until its requests are done: one parked in the pool would be missed."""
    semantic = GatedSemantic()
    semantic.gate.set()
    engine = gated_engine(model, redis_server, semantic)
    try:
        engine.lookups.shutdown()  # a pool that takes nothing: an own request that used it would fail
        sink = RecordingSink()
        engine.submit(request([1, 5, 6], sink, temperature=0.0, tier="warmup"), own=True)
        assert semantic.looked_up == 1 and engine.lookups.inline == 0
    finally:
        engine.shutdown(1.0)


def test_past_max_pending_a_lookup_runs_on_the_caller():
    pool = LookupPool(workers=1, max_pending=1)
    gate, ran_on = threading.Event(), []
    pool.run(lambda: gate.wait(10))  # takes the one pending place
    pool.run(lambda: ran_on.append(threading.current_thread().name))
    assert ran_on == [threading.current_thread().name] and pool.inline == 1
    gate.set()
    pool.shutdown()
    assert pool.pending == 0
    with pytest.raises(ValueError):
        LookupPool(workers=0)


def test_cache_hits_answered_on_two_threads_are_all_counted(model):  # noqa: F811
    """Exact hits are answered on the execute thread, semantic hits on a lookup thread: the engine's
    own finished count (the warmup report's, the stop log's) must lose none of them."""
    import sys

    engine = make_engine(model, slots=2)
    hit = request([1, 2, 3], RecordingSink(), temperature=0.0, max_tokens=2)
    hit.sink = SimpleNamespace(send=lambda *args: None, fail=lambda *args: None, cancelled=lambda: False)
    n, switch = 20000, sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=lambda: [engine._answer_from_cache(hit, [0], 0) for _ in range(n)])
                   for _ in range(2)]  # fmt: skip
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(switch)
    assert engine.stats.finished["cached"] == 2 * n


def test_waiting_lookups_are_taken_most_urgent_first():
    pool = LookupPool(workers=1)
    gate, order = threading.Event(), []
    pool.run(lambda: gate.wait(10))  # the one worker is busy
    for name, priority in (("standard", 3), ("batch", 4), ("critical", 1), ("standard-2", 3)):
        pool.run(lambda name=name: order.append(name), priority)
    assert pool.pending == 5
    gate.set()
    pool.shutdown()
    assert order == ["critical", "standard", "standard-2", "batch"] and pool.pending == 0


def test_a_task_that_raises_does_not_stop_the_pool():
    pool = LookupPool(workers=1)
    done = threading.Event()
    pool.run(lambda: 1 / 0)
    pool.run(done.set)
    assert done.wait(10) and pool.failed == 1
    pool.shutdown()
    ran_on = []
    pool.run(lambda: ran_on.append(threading.current_thread().name))  # shut down: runs here
    assert ran_on == [threading.current_thread().name] and pool.inline == 1
