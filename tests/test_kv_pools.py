"""KV slot pools per length class: the planner (pure) and the runner/engine serving from them."""

from __future__ import annotations

import math

import pytest
import torch

from engine.engine import Engine
from engine.model_runner import ModelRunner
from engine.prefix_cache import PrefixCache
from scheduler.kv_pools import KVPool, plan_kv_pools
from tests.test_engine_batching import BUCKETS, EOS, RecordingSink, model, request, run_until_idle  # noqa: F401

MAX_LEN = 4096
PLAN_BUCKETS = (64, 128, 256, 512, 1024, 2048)
# Reserved lengths (prompt + max_tokens) with a long tail: most requests are short.
HEAVY_TAIL = {100: 500, 200: 300, 600: 150, 1500: 40, 3000: 10}


def tail_share(histogram: dict[int, int], boundary: int) -> float:
    return sum(c for length, c in histogram.items() if length > boundary) / sum(histogram.values())


def test_too_little_history_gives_one_pool_of_the_limit():
    plan = plan_kv_pools({100: 10}, 8, MAX_LEN, PLAN_BUCKETS, min_samples=50)
    assert plan.source == "single" and plan.pools == (KVPool(MAX_LEN, 8),)
    assert plan.slot_tokens == plan.single_pool_tokens == 8 * MAX_LEN
    assert plan_kv_pools(HEAVY_TAIL, 1, MAX_LEN, PLAN_BUCKETS).pools == (KVPool(MAX_LEN, 1),)


def test_pools_cover_every_tail_of_the_recorded_lengths():
    plan = plan_kv_pools(HEAVY_TAIL, 16, MAX_LEN, PLAN_BUCKETS)
    capacities = [pool.capacity for pool in plan.pools]
    assert plan.source == "traffic" and plan.slots == 16
    assert capacities == sorted(capacities) and capacities[-1] == MAX_LEN
    assert set(capacities) <= set(PLAN_BUCKETS) | {MAX_LEN}
    for index, pool in enumerate(plan.pools[1:], start=1):
        boundary = plan.pools[index - 1].capacity
        holding = sum(p.slots for p in plan.pools[index:])
        assert holding >= math.ceil(16 * tail_share(HEAVY_TAIL, boundary) - 1e-9)
    assert plan.cuts["p50"] == 100 and plan.cuts["p99"] == 1500
    assert plan.slot_tokens < 0.5 * plan.single_pool_tokens


def test_the_longest_class_keeps_a_slot_without_long_traffic():
    plan = plan_kv_pools({40: 1000}, 4, MAX_LEN, PLAN_BUCKETS)
    assert plan.pools == (KVPool(64, 3), KVPool(MAX_LEN, 1))


def test_bad_slot_count_is_refused():
    with pytest.raises(ValueError, match="at least one slot"):
        plan_kv_pools(HEAVY_TAIL, 0, MAX_LEN, PLAN_BUCKETS)


def pooled_engine(model, pools, prefix_cache=False, tiers=None) -> Engine:  # noqa: F811
    slots = sum(count for _, count in pools)
    runner = ModelRunner(model, slots=slots, max_len=128, kv_buckets=BUCKETS, pools=pools)
    engine = Engine(runner, lambda t: bytes([97 + t % 26]), {EOS}, BUCKETS, tiers=tiers)
    if prefix_cache:
        engine.prefix_cache = PrefixCache(runner, 64, 4, "fp")
    return engine


def serve_together(engine: Engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    sinks = [RecordingSink() for _ in prompts]
    for index, (prompt, sink) in enumerate(zip(prompts, sinks, strict=True)):
        engine.submit(request(prompt, sink, rid=f"r{index}", max_tokens=max_tokens))
    run_until_idle(engine)
    assert all(sink.finished and not sink.errors for sink in sinks)
    return [sink.tokens for sink in sinks]


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_pooled_slots_give_the_single_pool_outputs(model, prefix_cache):  # noqa: F811
    """Decode steps whose longest sequence runs past the short pool's capacity (attention per pool)."""
    prompts = [[1, 7, 9], [1, *range(10, 60)], [1, 4, 4, 8], [1, *range(100, 170)]]
    single = serve_together(pooled_engine(model, [(128, 4)], prefix_cache), prompts, 12)
    engine = pooled_engine(model, [(32, 2), (128, 2)], prefix_cache)
    pooled = serve_together(engine, prompts, 12)
    assert pooled == single
    assert engine.runner.kv_bytes == (2 * 32 + 2 * 128) * engine.runner.kv_bytes_per_token
    assert engine.runner.kv_bytes < pooled_engine(model, [(128, 4)]).runner.kv_bytes


def test_requests_take_the_smallest_slot_that_fits(model):  # noqa: F811
    engine = pooled_engine(model, [(32, 1), (128, 1)])
    long_sink, short_sink = RecordingSink(), RecordingSink()
    engine.submit(request([1, *range(10, 40)], long_sink, rid="long", max_tokens=30))
    engine.submit(request([1, 5, 6], short_sink, rid="short", max_tokens=8))
    engine.step()
    slots = {state.request.request_id: state.slot for state in engine._active.values()}
    assert engine.runner.slot_capacity(slots["short"]) == 32
    assert engine.runner.slot_capacity(slots["long"]) == 128
    run_until_idle(engine)
    assert len(long_sink.tokens) == 30 and len(short_sink.tokens) == 8


def test_a_busy_long_class_does_not_block_short_requests_behind_it(model):  # noqa: F811
    engine = pooled_engine(model, [(32, 1), (128, 1)])
    first, waiting, short = RecordingSink(), RecordingSink(), RecordingSink()
    engine.submit(request([1, *range(10, 50)], first, rid="first", max_tokens=40))
    engine.step()  # "first" holds the only long slot
    engine.submit(request([1, *range(60, 100)], waiting, rid="waiting", max_tokens=40))
    engine.submit(request([1, 3, 5], short, rid="short", max_tokens=4))
    engine.step()
    active = {state.request.request_id for state in engine._active.values()}
    assert active == {"first", "short"}  # the short request went ahead into the short slot
    assert "waiting" in engine._queue  # the long one keeps its place for the long slot
    run_until_idle(engine)
    assert len(waiting.tokens) == 40 and len(short.tokens) == 4 and not waiting.errors


def test_pools_must_end_at_the_limit_and_hold_every_slot(model):  # noqa: F811
    with pytest.raises(ValueError, match="must hold 3 slots"):
        ModelRunner(model, slots=3, max_len=128, kv_buckets=BUCKETS, pools=[(32, 1), (128, 1)])
    with pytest.raises(ValueError, match="end at the sequence limit"):
        ModelRunner(model, slots=2, max_len=128, kv_buckets=BUCKETS, pools=[(32, 1), (64, 1)])


def test_compiled_decode_attends_per_pool_like_eager(model):  # noqa: F811
    runner = ModelRunner(model, slots=2, max_len=128, kv_buckets=BUCKETS, pools=[(16, 1), (128, 1)])
    prompts = ([1, 5, 9], list(range(1, 40)))

    def fill() -> None:
        for slot, prompt in enumerate(prompts):
            runner.prefill(slot, prompt, runner.bucket(len(prompt)))

    tokens, positions = torch.tensor([11, 12]), torch.tensor([3, 39])
    fill()
    eager = runner.decode(tokens, positions, 64).clone()
    runner.compile_decode(64)  # runs dummy steps over the slots: fill them again
    fill()
    compiled = runner.decode(tokens, positions, 64)
    assert runner.compiled_buckets == {64} and runner.compile_fallbacks == 0
    torch.testing.assert_close(compiled, eager, atol=1e-4, rtol=1e-4)


def test_preemption_takes_a_slot_long_enough_for_the_urgent_request(model):  # noqa: F811
    import time

    from scheduler.preemption import PreemptionPolicy

    from tests.test_preemption import URGENT_TIERS

    engine = pooled_engine(model, [(32, 1), (128, 1)], tiers=URGENT_TIERS)  # critical due within 1 ms
    engine.preemption = PreemptionPolicy()
    short_batch, long_batch, critical = RecordingSink(), RecordingSink(), RecordingSink()
    far = time.time_ns() + 3600 * 10**9
    batch = {"priority": 4, "tier": "batch", "deadline": far}
    engine.submit(request([1, 2, 3], short_batch, rid="short", max_tokens=25, **batch))
    engine.submit(request([1, *range(10, 40)], long_batch, rid="long", max_tokens=40, **batch))
    engine.step()
    slots = {s.request.request_id: s.slot for s in engine._active.values()}
    assert (
        engine.runner.slot_capacity(slots["short"]) == 32
        and engine.runner.slot_capacity(slots["long"]) == 128
    )
    urgent = [1, *range(50, 80)]  # 31 tokens + 8: only the long slot holds it
    engine.submit(
        request(
            urgent, critical, rid="crit", priority=1, tier="critical", deadline=time.time_ns(), max_tokens=8
        )
    )
    engine.step()
    assert engine.stats.preemptions == 1 and "long" in engine._suspended and "short" not in engine._suspended
    run_until_idle(engine)
    assert len(critical.tokens) == 8 and len(long_batch.tokens) == 40 and len(short_batch.tokens) == 25


def test_lengths_past_the_limit_all_count_toward_the_long_tail():
    """Lengths clamped to max_len used to overwrite each other's counts (a dict comprehension)."""
    max_len, slots = 4096, 10
    reserved = {100: 60, 5000: 20, 6000: 20}  # 40% need more than the short class
    plan = plan_kv_pools(reserved, slots, max_len, (64, 128, 256, 512, 1024, 2048))
    assert plan.samples == 100
    long_slots = sum(p.slots for p in plan.pools if p.capacity > 128)
    assert long_slots >= math.ceil(slots * 0.4), plan.pools
