"""A cache tier that raises (a bug, a device or host memory failure: Redis errors are absorbed by the store
itself) never fails a request, nor the requests running beside it: the lookup keeps the prefix found so
far, the store or demotion is dropped and counted, and no L1 row is lost. Also L2's chain order: a
chain demoted from L1 ages tail first, as in L1, so that what L2 drops is never a head whose tail it keeps."""

from __future__ import annotations

import time

import pytest
import torch

from cache.circuit_breaker import CircuitBreaker
from cache.cost_model import LoadCostModel
from cache.kv_format import KVBlockMeta, dtype_name
from cache.redis_kv_store import RedisKVStore
from engine.engine import Engine
from engine.kv_tiers import LAYOUT, L3Tier
from engine.l2_pool import HostBlockPool
from engine.model_runner import ModelRunner
from engine.prefix_cache import PrefixCache
from scheduler.preemption import PreemptionPolicy
from tests.conftest import wait_for
from tests.test_preemption import URGENT_TIERS, critical_request
from tests.test_engine_batching import BUCKETS, EOS, RecordingSink, model, request, run_until_idle  # noqa: F401

P = [1, *range(40, 88)]  # 49 tokens: 3 full blocks of 16
Q = [1, *range(120, 168)]  # another 3 blocks
C = [1, *range(200, 216)]  # 1 block


def make(model, slots=1, l1=None, l2=None, **kw) -> Engine:  # noqa: F811
    runner = ModelRunner(model, slots=slots, max_len=128, kv_buckets=BUCKETS)
    engine = Engine(runner, lambda t: bytes([97 + t % 26]), {EOS}, BUCKETS, **kw)
    if l1:
        engine.prefix_cache = cache = PrefixCache(runner, l1, 16, "fp")
        if l2:
            cache.l2 = HostBlockPool(l2, tuple(cache.pool.shape[1:]), cache.pool.dtype, pin=False)
    return engine


def serve(engine: Engine, prompt: list[int], max_tokens: int = 4, **kw) -> RecordingSink:
    sink = RecordingSink()
    engine.submit(request(prompt, sink, max_tokens=max_tokens, **kw))
    run_until_idle(engine)
    return sink


def reference(model, prompt: list[int], max_tokens: int = 4) -> list[int]:  # noqa: F811
    sink = serve(make(model), prompt, max_tokens)
    assert not sink.errors
    return sink.tokens


def fail(*args: object, **kwargs: object) -> None:
    raise RuntimeError("injected tier failure")


def rows_accounted(cache: PrefixCache) -> bool:
    return sorted([*cache.index.values(), *cache.free]) == list(range(cache.capacity))


def test_an_l2_lookup_that_raises_is_a_miss_and_the_request_computes(model):  # noqa: F811
    engine = make(model, l1=3, l2=6)
    serve(engine, P + [5])
    serve(engine, Q + [5])  # P's blocks go to L2
    engine.prefix_cache.l2.take_run = fail
    sink = serve(engine, P + [7])
    assert not sink.errors and sink.tokens == reference(model, P + [7])
    assert engine.prefix_cache.tier_errors == 1 and "l2 lookup" in engine.prefix_cache.last_tier_error


def test_an_l3_tier_that_raises_is_a_miss_and_the_request_computes(model, redis_server):  # noqa: F811
    namespace = f"faults:{time.monotonic_ns()}"

    def replica() -> Engine:
        engine = make(model, l1=8)
        shape, cache = engine.runner.shape, engine.prefix_cache
        block = (shape.layers, 2, shape.kv_heads, 16, shape.head_dim)
        meta = KVBlockMeta("fp", dtype_name(engine.runner.dtype), block, 16, LAYOUT)
        cost = LoadCostModel()
        cost.decide = lambda *args, **kwargs: "load"
        store = RedisKVStore(redis_server, namespace, timeout_s=0.5, breaker=CircuitBreaker())
        cache.l3, cache.publish_on_first_use = L3Tier(store, meta, cost), True
        return engine

    first, second = replica(), replica()
    try:
        serve(first, P + [9])
        assert first.prefix_cache.l3._writes.drain()
        assert (
            second.prefix_cache.l3.store.exists_chain(second.prefix_cache.chain_keys(P + [9], "default")) == 3
        )
        second.prefix_cache.l3.store.get_chain = fail
        sink = serve(second, P + [9])
        assert not sink.errors and sink.tokens == reference(model, P + [9])
        assert second.prefix_cache.tier_errors == 1 and "l3 lookup" in second.prefix_cache.last_tier_error
    finally:
        first.prefix_cache.l3.close()
        second.prefix_cache.l3.close()


def test_a_demotion_that_raises_fails_no_running_request_and_loses_no_l1_row(model):  # noqa: F811
    """The store after a first token demotes L1 blocks to L2; its failure went through the engine loop's
    catch-all, which failed every running request, and the rows it had taken were lost for good."""
    engine = make(model, slots=2, l1=3, l2=6)
    serve(engine, P + [5], max_tokens=2)
    cache, calls = engine.prefix_cache, []
    real = cache.l2.put_many

    def flaky(*args: object, **kwargs: object) -> int:
        calls.append(1)
        return fail() if len(calls) == 1 else real(*args, **kwargs)

    cache.l2.put_many = flaky
    a, b = RecordingSink(), RecordingSink()
    engine.start()
    try:
        engine.submit(request(Q + [5], a, rid="a", max_tokens=6))
        engine.submit(request([1, 2, 3, 4], b, rid="b", max_tokens=6))
        assert wait_for(lambda: a.finished and b.finished and not engine._active, 10)
    finally:
        engine.shutdown(1)
    assert not a.errors and not b.errors, (a.errors, b.errors)
    assert a.tokens == reference(model, Q + [5], 6) and b.tokens == reference(model, [1, 2, 3, 4], 6)
    assert calls and cache.tier_errors == 1 and rows_accounted(cache)


def test_a_park_that_raises_on_preemption_loses_neither_request(model):  # noqa: F811
    """Preemption pops the urgent request, then parks the victim's KV: a park that raised left the
    popped request unanswered for good and failed the victim."""
    engine = make(model, l1=3, l2=4, preemption=PreemptionPolicy(), tiers=URGENT_TIERS)
    serve(engine, Q + [5], max_tokens=1)  # L1 full: parking must demote to L2
    batch, critical = RecordingSink(), RecordingSink()
    prompt = [1, *range(40, 75)]
    engine.submit(
        request(prompt, batch, rid="batch", priority=4, tier="batch", deadline=2**62, max_tokens=40)
    )
    for _ in range(16):
        engine.step()
    engine.prefix_cache.l2.put_many = fail
    engine.start()
    try:
        engine.submit(critical_request(critical))
        assert wait_for(lambda: critical.finished and batch.finished, 10), "a request was never answered"
    finally:
        engine.shutdown(1)
    assert not critical.errors and not batch.errors, (critical.errors, batch.errors)
    assert batch.tokens == reference(model, prompt, 40)


def test_a_chain_demoted_to_l2_loses_its_tail_first(model):  # noqa: F811
    """L2 gave a chain's blocks their ages in row order, head first: its next eviction took the head and
    kept a tail no lookup can reach (a lookup stops at the first block it lacks)."""
    engine = make(model, l1=3, l2=3)
    cache = engine.prefix_cache
    serve(engine, P + [5], max_tokens=2)
    serve(engine, Q + [5], max_tokens=2)  # P's three blocks go to L2
    keys = cache.chain_keys(P + [5], "default")
    assert all(key in cache.l2 for key in keys)
    serve(engine, C + [5], max_tokens=2)  # one of Q's blocks goes to L2, which drops one of P's
    assert [key in cache.l2 for key in keys] == [True, True, False]


@pytest.mark.parametrize("uses", [1, 2])
def test_a_chain_taken_from_l2_ages_tail_first_too(uses: int):
    """Demoted tail first (eviction order), then hit head first: the head must stay the most recent."""
    pool = HostBlockPool(4, (2,), dtype=torch.float32, pin=False)
    chain = [b"head", b"middle", b"tail"]
    pool.put_many(chain[::-1], torch.zeros(3, 2))
    for _ in range(uses):
        assert pool.take_run(chain) == [pool.index[key] for key in chain]
    assert pool.victim() == b"tail"
