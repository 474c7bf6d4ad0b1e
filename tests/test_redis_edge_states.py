"""Redis edge states found in review (2026-12-08).

1. A read-only replica (after a failover) and a bad value under one of our names: the exact and semantic
   caches' delete of it is refused (READONLY). That refusal is a write refused, not a Redis failure
   (`cache/redis_full.py`): counted as one, every lookup of a damaged answer records a breaker failure
   and an error, so concurrent lookups of it open the breaker and stop every tenant's hits, for as long
   as the replica serves. L3 (`RedisKVStore._call`) already treats it as a refused write.
2. The key directory's reconnect backoff grew across streaks and was never reset by a good resync: after
   a few disconnects days apart (the server killing the subscriber for `client-output-buffer-limit
   pubsub`, a restart) each later one left the directory unsynced for up to 10 s, and only the first
   streak ever was logged.
"""

from __future__ import annotations

import threading
import time
import uuid


from cache.key_directory import KeyDirectory, announce_channel
from cache.response_cache import ExactResponseCache
from cache.semantic_cache import SemanticResponseCache
from scheduler.messages import EngineRequestParams
from tests.conftest import answer, wait_for
from tests.test_redis_full import _make_replica, own_redis
from tests.test_semantic_versions import NoEmbedder, vec

GREEDY = EngineRequestParams(max_tokens=8)


def test_a_damaged_answer_on_a_read_only_replica_is_a_refused_write_not_a_breaker_failure(tmp_path):
    with own_redis(tmp_path) as (url, client):
        cache = ExactResponseCache(url, fingerprint=f"fp-{uuid.uuid4().hex[:8]}", timeout_s=0.5)
        try:
            assert cache.put([1, 2, 3], GREEDY, answer("kept before the failover"))
            client.set(cache.key([9], GREEDY), b"damaged")
            _make_replica(client)
            barrier = threading.Barrier(8)

            def lookups() -> None:  # concurrent requests of the damaged prompt (engine.submit's threads)
                barrier.wait()
                for _ in range(20):
                    assert cache.get([9], GREEDY) is None

            threads = [threading.Thread(target=lookups) for _ in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert cache.get([1, 2, 3], GREEDY) == answer("kept before the failover")
            stats = cache.snapshot()
            assert (stats["errors"], cache.breaker.failures, cache.breaker.opens) == (0, 0, 0), stats
            assert stats["readonly_refusals"] >= 1 and stats["corrupt"] == 160
        finally:
            cache.close()


def semantic_cache(url: str) -> tuple[SemanticResponseCache, str]:
    """A semantic cache of its own fingerprint, and a fresh tenant of it."""
    cache = SemanticResponseCache(
        url, f"fp-{uuid.uuid4().hex[:8]}", NoEmbedder(), verifier=None, timeout_s=0.5
    )
    return cache, f"t-{uuid.uuid4().hex[:8]}"


def test_a_damaged_semantic_entry_on_a_read_only_replica_is_a_refused_write_not_a_breaker_failure(tmp_path):
    with own_redis(tmp_path) as (url, client):
        cache, tenant = semantic_cache(url)
        try:
            assert cache.store(
                "How do I reset my password?", tenant, GREEDY, answer("reset"), embedding=vec(0)
            )
            _, doc_key, _, stamp_key = cache._keys(tenant)
            entry = next(iter(client.hkeys(doc_key)))
            client.hset(doc_key, entry, b"{}")  # a damaged document
            client.incr(stamp_key)
            _make_replica(client)
            for _ in range(5):  # each lookup re-reads the tenant: the refused delete left the stamp
                assert cache.lookup("How do I reset my password?", tenant, GREEDY, embedding=vec(0)) is None
            stats = cache.snapshot()
            assert (stats["errors"], cache.breaker.failures) == (0, 0), stats
            assert stats["readonly_refusals"] >= 1
        finally:
            cache.close()


def test_a_wrong_type_tenant_key_on_a_read_only_replica_is_not_a_breaker_failure(tmp_path):
    with own_redis(tmp_path) as (url, client):
        cache, tenant = semantic_cache(url)
        try:
            client.hset(cache._keys(tenant)[3], "x", "y")  # the version stamp holds a hash
            _make_replica(client)
            for _ in range(5):
                assert cache.lookup("How do I reset my password?", tenant, GREEDY, embedding=vec(0)) is None
            stats = cache.snapshot()
            assert (stats["errors"], cache.breaker.failures) == (0, 0), stats
        finally:
            cache.close()


def test_the_directory_resyncs_at_once_after_each_output_buffer_kill_and_logs_each(tmp_path):
    """The server kills a subscriber whose output buffer passes `client-output-buffer-limit pubsub` (a burst
    of announcements it read too slowly): each kill, however many came before, is followed by a resync
    within the first backoff step, and logged."""
    with own_redis(tmp_path) as (url, client):
        namespace = f"test:kd:{uuid.uuid4().hex[:8]}"
        client.set(f"{namespace}:held", b"x")
        logged: list[str] = []
        directory = KeyDirectory(url, namespace, log=logged.append).start()
        try:
            assert wait_for(lambda: directory.synced, 10)
            client.config_set("client-output-buffer-limit", "pubsub 4096 0 0")
            burst = "\n".join(f"{namespace}:{i:064x}" for i in range(200)).encode()  # ~17 KB
            for kill in range(1, 6):
                disconnects = directory.stats.disconnects
                client.publish(announce_channel(namespace), burst)
                assert wait_for(lambda: directory.stats.disconnects > disconnects, 5), "the server kills it"
                started = time.monotonic()
                assert wait_for(lambda: directory.synced, 15)
                assert time.monotonic() - started < 1.0, (
                    f"kill {kill}: resynced after {time.monotonic() - started:.1f} s"
                )
                assert directory.contains(f"{namespace}:held") is True
            assert len(logged) == 5, logged
        finally:
            directory.close()
