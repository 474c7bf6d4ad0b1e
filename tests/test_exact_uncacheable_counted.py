"""`llm_engine_cache_total{tier="exact", counter="uncacheable"}` ("get/put calls for non-deterministic
requests") against scripted ground truth on a real engine: a sampled request without a seed asks the
response cache (cache "use") and is neither a hit nor a miss; it must be counted uncacheable, once. The
response tier returned before asking the exact cache, so the counter stayed 0 whatever the traffic
(found in review)."""

from __future__ import annotations

from engine.cache_stats import cache_counters
from tests.test_engine_batching import model  # noqa: F401
from tests.test_engine_cache_modes import P, running, serve


def test_a_sampled_request_is_counted_uncacheable_once_and_neither_hit_nor_miss(model, redis_server):  # noqa: F811
    with running(model, redis_server) as engine:
        serve(engine, P, temperature=0.8)  # sampled, no seed: never cached
        serve(engine, P, temperature=0.8)
        serve(engine, P)  # greedy: a miss, then written (first use)
        engine.responses.drain_writes()
        serve(engine, P)  # greedy again: a hit
        c = cache_counters(engine.prefix_cache, engine.responses)
        got = (c[("exact", "uncacheable")], c[("exact", "hits")], c[("exact", "misses")])
        assert got == (2, 1, 1), f"(uncacheable, hits, misses) = {got}"


def test_a_seeded_request_is_cacheable_and_not_counted_uncacheable(model, redis_server):  # noqa: F811
    with running(model, redis_server) as engine:
        serve(engine, P, temperature=0.8, seed=7)
        c = cache_counters(engine.prefix_cache, engine.responses)
        assert (c[("exact", "uncacheable")], c[("exact", "misses")]) == (0, 1)


def test_a_sampled_request_that_reads_no_response_cache_is_not_counted(model, redis_server):  # noqa: F811
    """cache "refresh" and "kv-only" never ask the response caches: nothing to count."""
    with running(model, redis_server) as engine:
        serve(engine, P, temperature=0.8, cache="kv-only")
        serve(engine, P, temperature=0.8, cache="refresh")
        c = cache_counters(engine.prefix_cache, engine.responses)
        assert (c[("exact", "uncacheable")], c[("exact", "hits")], c[("exact", "misses")]) == (0, 0, 0)
