"""L3 hits and bytes count only blocks L1 had room for: L3 is asked for no more (review, 2026-12-07)."""

from __future__ import annotations

from cache.circuit_breaker import CircuitBreaker
from cache.cost_model import LoadCostModel
from cache.kv_format import KVBlockMeta, dtype_name
from cache.redis_kv_store import RedisKVStore
from engine.cache_stats import cache_counters
from engine.engine import Engine
from engine.kv_tiers import LAYOUT, L3Tier
from engine.model_runner import ModelRunner
from engine.prefix_cache import PrefixCache
from tests.test_engine_batching import BUCKETS, EOS, model  # noqa: F401
from tests.test_kv_tiers import PROMPT, replica, serve


def small_replica(model, redis_url, namespace, l1_blocks):  # noqa: F811
    runner = ModelRunner(model, slots=1, max_len=128, kv_buckets=BUCKETS)
    engine = Engine(runner, lambda t: bytes([97 + t % 26]), {EOS}, BUCKETS)
    engine.prefix_cache = PrefixCache(runner, l1_blocks, 16, "fp")
    shape = runner.shape
    meta = KVBlockMeta(
        "fp", dtype_name(runner.dtype), (shape.layers, 2, shape.kv_heads, 16, shape.head_dim), 16, LAYOUT
    )
    store = RedisKVStore(redis_url, namespace, timeout_s=0.2, breaker=CircuitBreaker())
    engine.prefix_cache.l3 = L3Tier(store, meta, LoadCostModel(prior_prefill_tokens_per_s=50.0))
    return engine


def test_l3_hits_are_the_blocks_it_served(model, redis_server, request):  # noqa: F811
    namespace = f"mx:{request.node.name}"
    first = replica(model, redis_server, namespace)
    serve(first, PROMPT + [5])
    first.prefix_cache.l3.close()
    second = small_replica(model, redis_server, namespace, l1_blocks=2)
    serve(second, PROMPT + [5])
    c = cache_counters(second.prefix_cache, None)
    served = second.stats.prefix_reused_tokens // 16
    assert served == 2 and c[("l3", "tokens_loaded")] == 32
    assert c[("l3", "hits")] == served, f"L3 hits {c[('l3', 'hits')]} blocks, served {served}"
    second.prefix_cache.l3.close()
