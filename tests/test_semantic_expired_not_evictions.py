"""Semantic `evictions` against scripted ground truth: a store deletes the tenant's entries past their TTL
(per-entry expiry, which Redis cannot do inside a hash) and, past `max_entries_per_tenant`, its oldest.
Only the latter is an eviction: an expired entry would never have been served again, and counting it
tells an operator the tenant's bound is too small when it was never reached. Found in review."""

from __future__ import annotations

import time
import uuid

from cache.semantic_cache import SemanticResponseCache
from scheduler.messages import EngineRequestParams
from tests.conftest import answer
from tests.test_empty_normal_form import TextHashEmbedder

GREEDY = EngineRequestParams(max_tokens=32)


def _cache(redis_server, **options) -> SemanticResponseCache:
    return SemanticResponseCache(
        redis_server, f"fp-{uuid.uuid4().hex[:8]}", TextHashEmbedder(), verifier=None, **options
    )


def _age(cache, tenant, prompt, seconds_ago):
    """Move an entry's write time back, as if it had been written `seconds_ago`."""
    entry = cache.entry_id(cache.signature(GREEDY), prompt)
    cache.client.zadd(cache._keys(tenant)[2], {entry: time.time() - seconds_ago})


def test_an_entry_past_its_ttl_pruned_by_a_store_is_no_eviction(redis_server):
    cache = _cache(redis_server, ttl_s=3600, max_entries_per_tenant=100)
    try:
        cache.store("What is the capital of France?", "t1", GREEDY, answer(" Paris"))
        _age(cache, "t1", "What is the capital of France?", 7200)  # past the TTL: never served again
        cache.store("How tall is Mount Everest?", "t1", GREEDY, answer(" 8849 m"))
        counts = cache.snapshot()
        assert counts["evictions"] == 0, f"an expired entry counted as an eviction: {counts}"
        assert counts["expired"] == 1
    finally:
        cache.close()


def test_an_entry_past_the_tenants_bound_is_an_eviction(redis_server):
    cache = _cache(redis_server, ttl_s=3600, max_entries_per_tenant=1)
    try:
        cache.store("What is the capital of France?", "t1", GREEDY, answer(" Paris"))
        cache.store("How tall is Mount Everest?", "t1", GREEDY, answer(" 8849 m"))
        counts = cache.snapshot()
        assert (counts["evictions"], counts.get("expired", 0)) == (1, 0), counts
    finally:
        cache.close()


def test_an_expired_entry_that_also_makes_room_counts_once_as_expired(redis_server):
    """Bound 2, entries A (expired) and B, a store of C: deleting A brings the tenant back to its bound,
    so B stays and nothing is evicted."""
    cache = _cache(redis_server, ttl_s=3600, max_entries_per_tenant=2)
    try:
        cache.store("What is the capital of France?", "t1", GREEDY, answer(" Paris"))
        cache.store("How tall is Mount Everest?", "t1", GREEDY, answer(" 8849 m"))
        _age(cache, "t1", "What is the capital of France?", 7200)
        cache.store("Who wrote Hamlet?", "t1", GREEDY, answer(" Shakespeare"))
        counts = cache.snapshot()
        assert (counts["evictions"], counts.get("expired", 0)) == (0, 1), counts
        assert cache.client.zcard(cache._keys("t1")[2]) == 2
    finally:
        cache.close()
