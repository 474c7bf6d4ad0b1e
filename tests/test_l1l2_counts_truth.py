"""The L1 and L2 counters against scripted ground truth (review, 2026-12-07)."""

from __future__ import annotations

from engine.cache_stats import cache_counters
from engine.engine import Engine
from engine.l2_pool import HostBlockPool
from engine.model_runner import ModelRunner
from engine.prefix_cache import PrefixCache
from tests.test_engine_batching import BUCKETS, EOS, model  # noqa: F401
from tests.test_kv_tiers import serve

A = [1] + list(range(10, 58))  # 3 full blocks + 1 token
B = [1] + list(range(110, 158))


def engine_with(model, l1_blocks, l2_blocks):  # noqa: F811
    runner = ModelRunner(model, slots=1, max_len=128, kv_buckets=BUCKETS)
    engine = Engine(runner, lambda t: bytes([97 + t % 26]), {EOS}, BUCKETS)
    cache = engine.prefix_cache = PrefixCache(runner, l1_blocks, 16, "fp")
    if l2_blocks:
        cache.l2 = HostBlockPool(l2_blocks, tuple(cache.pool.shape[1:]), cache.pool.dtype, pin=False)
    return engine


def test_l1_demotes_to_l2_and_l2_serves_counted_once(model):  # noqa: F811
    engine = engine_with(model, 4, 8)
    serve(engine, A)  # L1: A0 A1 A2 (3 misses in L1, 3 in L2)
    serve(engine, B)  # B needs 3 rows: 1 free, 2 of A evicted (tails first) to L2
    serve(engine, A)  # A0 in L1; A1, A2 from L2 (2 rows: B's tail evicted to L2)
    c = cache_counters(engine.prefix_cache, None)
    bb = engine.prefix_cache.bytes // engine.prefix_cache.capacity
    assert engine.stats.prefix_reused_tokens == 48
    assert (c[("l1", "hit_blocks")], c[("l1", "miss_blocks")]) == (1, 3 + 3 + 2)
    assert (c[("l2", "hit_blocks")], c[("l2", "miss_blocks")]) == (2, 3 + 3 + 0)
    assert (c[("l1", "evictions")], c[("l2", "evictions")]) == (4, 0)
    assert (c[("l1", "tokens_loaded")], c[("l2", "tokens_loaded")]) == (16, 32)
    assert (c[("l1", "bytes_loaded")], c[("l2", "bytes_loaded")]) == (bb, 2 * bb)
    assert c[("l1", "seconds_saved")] >= 0 and c[("l2", "seconds_saved")] >= 0


def test_l2_evictions_when_full(model):  # noqa: F811
    engine = engine_with(model, 3, 3)
    prompts = [[1] + list(range(10 + 50 * i, 58 + 50 * i)) for i in range(4)]
    for p in prompts:
        serve(engine, p)  # each evicts the previous 3 from L1 into L2; L2 (3) drops the older ones
    c = cache_counters(engine.prefix_cache, None)
    assert c[("l1", "evictions")] == 9
    assert c[("l2", "evictions")] == 6
    assert len(engine.prefix_cache.l2.index) == 3
