"""The L3 counters against scripted ground truth: a chain that served nothing is no hit, a chain Redis
lacks is a miss (found in review, 2026-12-07)."""

from __future__ import annotations

from cache.cost_model import LoadCostModel
from client.cache_report import tier_rows
from engine.cache_stats import cache_counters
from tests.test_engine_batching import model  # noqa: F401
from tests.test_kv_tiers import PROMPT, replica, serve


def _metrics(counters):
    """The counters as the /metrics scrape the cache report reads."""
    return {
        f'llm_engine_cache_total{{counter="{c}",model="llm_engine",tier="{t}"}}': v
        for (t, c), v in counters.items()
    }


def _first_replica_wrote(model, redis_server, namespace, prompt):  # noqa: F811
    first = replica(model, redis_server, namespace)
    serve(first, prompt)
    first.prefix_cache.l3.close()  # flushes the writes
    return first.prefix_cache.l3.store.client


def test_a_chain_whose_head_block_is_corrupt_served_nothing_and_is_no_l3_hit(model, redis_server, request):  # noqa: F811
    """Ground truth: Redis holds the 3 blocks of PROMPT, the head block damaged. The second replica's
    lookup loads nothing (checksum failure), recomputes all 48 tokens. L3 served 0 chains."""
    namespace = f"mx:{request.node.name}"
    prompt = PROMPT + [7]
    raw = _first_replica_wrote(model, redis_server, namespace, prompt)
    second = replica(model, redis_server, namespace, cost=LoadCostModel(prior_prefill_tokens_per_s=50.0))
    head = second.prefix_cache.l3.store.redis_key(second.prefix_cache.chain_keys(prompt, "default")[0])
    raw.setrange(head, 40, b"\x00\xff\x00\xff")
    serve(second, prompt)
    counters = cache_counters(second.prefix_cache, None)
    assert second.stats.prefix_reused_tokens == 0  # nothing was served from any tier
    assert counters[("l3", "checksum_failures")] == 1 and counters[("l3", "hits")] == 0
    assert counters[("l3", "tokens_loaded")] == 0
    l3 = next(row for row in tier_rows(_metrics(counters)) if row.tier == "l3")
    assert l3.hits == 0, (
        f"a chain that served no block (its head was corrupt) counted as an L3 hit: {counters}"
    )
    second.prefix_cache.l3.close()


def test_a_chain_whose_mget_failed_is_no_l3_hit(model, redis_server, request):  # noqa: F811
    """The probe said Redis holds the chain; the MGET then fails (Redis trouble): nothing served."""
    namespace = f"mx:{request.node.name}"
    prompt = PROMPT + [8]
    _first_replica_wrote(model, redis_server, namespace, prompt)
    second = replica(model, redis_server, namespace, cost=LoadCostModel(prior_prefill_tokens_per_s=50.0))
    store = second.prefix_cache.l3.store

    def failing_mget(names):
        import redis

        raise redis.ConnectionError("MGET timed out")

    store._mget = failing_mget
    serve(second, prompt)
    counters = cache_counters(second.prefix_cache, None)
    assert second.stats.prefix_reused_tokens == 0 and counters[("l3", "errors")] == 1
    l3 = next(row for row in tier_rows(_metrics(counters)) if row.tier == "l3")
    assert (l3.hits, l3.misses) == (0, 1), f"a chain L3 failed to serve counted as a hit: {counters}"
    second.prefix_cache.l3.close()


def test_l3_misses_count_the_chains_redis_lacks(model, redis_server, request):  # noqa: F811
    """Ground truth: 3 prompts no replica computed; L3 is asked for each chain and holds none of them.
    `llm_engine_cache_total{tier="l3",counter="misses"}` (README: "L3 hits, misses") must count them."""
    namespace = f"mx:{request.node.name}"
    engine = replica(model, redis_server, namespace)
    for i in range(3):
        serve(engine, [1] + list(range(110 + 40 * i, 150 + 40 * i)))
    counters = cache_counters(engine.prefix_cache, None)
    assert counters[("l3", "chains_missing")] == 3
    assert counters[("l3", "misses")] == 3, (
        f"L3 missed 3 chains, its misses counter says {counters[('l3', 'misses')]}"
    )
    engine.prefix_cache.l3.close()
