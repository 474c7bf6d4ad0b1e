"""The semantic cache's per-tenant version stamp, which decides when a replica re-reads a tenant's
entries from Redis, against a real redis-server: an erased tenant's answers are never served from a
replica's memory, and a replica's cleanup of bad entries never passes off a stale copy as current."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import redis

from cache.semantic_cache import SemanticResponseCache
from cache.tenant_erasure import erase_tenant
from scheduler.messages import EngineRequestParams
from tests.conftest import answer

GREEDY = EngineRequestParams(max_tokens=32)
RESET, FRANCE = "How do I reset my password?", "What is the capital of France?"


class NoEmbedder:
    def embed(self, texts):
        raise AssertionError("the tests pass embeddings")

    def fits(self, texts):
        return [True] * len(texts)


def vec(i: int, dim: int = 384) -> np.ndarray:
    v = np.zeros(dim, np.float32)
    v[i] = 1.0
    return v


@pytest.fixture
def replicas(redis_server):
    """Two replicas of one model, and the tenant they serve."""
    fingerprint = f"fp-{uuid.uuid4().hex[:8]}"
    pair = [SemanticResponseCache(redis_server, fingerprint, NoEmbedder(), verifier=None) for _ in range(2)]
    yield *pair, f"t-{uuid.uuid4().hex[:8]}"
    for cache in pair:
        cache.close()


def erase(cache: SemanticResponseCache, tenant: str) -> None:
    client = redis.Redis(connection_pool=cache.client.connection_pool)
    erase_tenant(client, tenant)


def test_an_erased_answer_is_not_served_after_the_tenant_stores_again(replicas):
    a, b, tenant = replicas
    assert b.store(RESET, tenant, GREEDY, answer("SECRET"), embedding=vec(0))
    assert a.lookup(RESET, tenant, GREEDY, embedding=vec(0)).answer == answer("SECRET")
    erase(b, tenant)
    assert b.store(FRANCE, tenant, GREEDY, answer("Paris"), embedding=vec(1))
    assert a.lookup(RESET, tenant, GREEDY, embedding=vec(0)) is None
    assert a.lookup(FRANCE, tenant, GREEDY, embedding=vec(1)).answer == answer("Paris")


def test_entries_read_without_a_stamp_are_not_reused_once_erased(replicas):
    a, b, tenant = replicas
    assert b.store(RESET, tenant, GREEDY, answer("SECRET"), embedding=vec(0))
    b.client.delete(b._keys(tenant)[3])  # the stamp alone evicted by a bounded Redis
    assert a.lookup(RESET, tenant, GREEDY, embedding=vec(0)).answer == answer("SECRET")
    erase(b, tenant)
    assert a.lookup(RESET, tenant, GREEDY, embedding=vec(0)) is None


def with_a_bad_entry(cache: SemanticResponseCache, tenant: str) -> None:
    assert cache.store(RESET, tenant, GREEDY, answer("reset answer"), embedding=vec(0))
    assert cache.store("Is there a dark mode?", tenant, GREEDY, answer("dark answer"), embedding=vec(5))
    emb, doc, _, _ = cache._keys(tenant)
    cache.client.hset(emb, b"f" * 24, cache.client.hget(emb, next(iter(cache.client.hkeys(doc)))))


def before_cleanup(cache: SemanticResponseCache, action) -> None:
    """Run `action` (another replica's write) between `cache`'s next read of the tenant and its cleanup;
    later cleanups run as they are."""
    real = cache._delete_script

    def delete_script(keys, args):
        cache._delete_script = real
        action()
        return real(keys=keys, args=args)

    cache._delete_script = delete_script


def test_an_entry_stored_during_a_cleanup_is_seen(replicas):
    a, b, tenant = replicas
    with_a_bad_entry(b, tenant)
    before_cleanup(
        a, lambda: b.store("How do I track my package?", tenant, GREEDY, answer("track"), embedding=vec(7))
    )
    a.lookup(RESET, tenant, GREEDY, embedding=vec(0))
    assert a.lookup("How do I track my package?", tenant, GREEDY, embedding=vec(7)).answer == answer("track")
    # the bad entry is counted once, by the read whose cleanup deleted it (the first was refused)
    assert a.snapshot()["incomplete"] + a.snapshot()["corrupt"] == 1


def test_an_erasure_during_a_cleanup_leaves_nothing_served_and_no_stamp_without_ttl(replicas):
    a, _, tenant = replicas
    with_a_bad_entry(a, tenant)
    before_cleanup(a, lambda: erase(a, tenant))
    a.lookup("Is there a dark mode?", tenant, GREEDY, embedding=vec(5))
    assert a.client.ttl(a._keys(tenant)[3]) != -1, "the cleanup recreated the stamp with no expiry"
    assert a.lookup(RESET, tenant, GREEDY, embedding=vec(0)) is None
