"""Response caches against a second replica writing between a read and its repair (found in review,
2026-12-07): a bad value or entry is deleted only while it is still the one read, and a miss never
hides a key whose write was announced meanwhile. Also: a lookup of a prompt UTF-8 cannot encode."""

from __future__ import annotations

import uuid

import redis

from cache.key_directory import KeyDirectory
from cache.response_cache import ExactAnswer, ExactResponseCache, exact_namespace
from cache.semantic_cache import SemanticResponseCache
from scheduler.messages import EngineRequestParams
from tests.conftest import wait_for
from tests.test_semantic_verifier import OneHotEmbedder, unit

Q = "How do I reset my password?"


def params(n: int = 8, tenant: str = "t") -> EngineRequestParams:
    return EngineRequestParams(max_tokens=n, temperature=0.0, tenant=tenant)


def final(n: int) -> ExactAnswer:
    return ExactAnswer(tuple(range(n)), final=True)


def test_exact_corrupt_cleanup_spares_a_good_value_another_replica_just_wrote(redis_server, monkeypatch):
    """Replica A GETs a corrupt value; replica B writes the good answer; A's repair must not delete it."""
    fp = f"fp-{uuid.uuid4().hex[:8]}"
    reader = ExactResponseCache(redis_server, fp, timeout_s=0.5)
    writer = ExactResponseCache(redis_server, fp, timeout_s=0.5)
    raw = redis.Redis.from_url(redis_server)
    try:
        key = reader.key([1, 2], params())
        raw.set(key, b"garbage")  # bit rot / truncated value
        real_get = reader.client.get

        def get_then_other_replica_writes(k):
            value = real_get(k)
            assert writer.put([1, 2], params(), final(4))
            return value

        monkeypatch.setattr(reader.client, "get", get_then_other_replica_writes)
        assert reader.get([1, 2], params()) is None  # the corrupt value: a miss, fine
        assert writer.get([1, 2], params()) == final(4), "the answer written meanwhile was deleted"
    finally:
        reader.close()
        writer.close()
        raw.close()


def test_semantic_corrupt_cleanup_spares_an_entry_another_replica_just_stored(redis_server):
    """Replica A reads the tenant (an entry's document is corrupt); replica B stores that prompt's answer
    again (a good entry, stamp moved); A's delete script must leave it."""
    fp = f"fp-{uuid.uuid4().hex[:8]}"
    emb = OneHotEmbedder({Q: unit(1)})
    reader = SemanticResponseCache(redis_server, fp, emb, verifier=None)
    writer = SemanticResponseCache(redis_server, fp, emb, verifier=None)
    try:
        assert writer.store(Q, "t", params(), final(4))
        entry = writer.entry_id(writer.signature(params()), Q)
        writer.client.hset(writer._keys("t")[1], entry, b"{}")  # the document corrupted
        real_delete = reader._delete_script

        def other_replica_stores_first(keys, args):
            assert writer.store(Q, "t", params(), final(4))
            return real_delete(keys=keys, args=args)

        reader._delete_script = other_replica_stores_first
        assert reader.lookup(Q, "t", params()) is None
        reader._delete_script = real_delete
        hit = reader.lookup(Q, "t", params())
        assert hit is not None, f"the entry stored meanwhile was deleted: {reader.snapshot()}"
    finally:
        reader.close()
        writer.close()


def test_exact_miss_keeps_a_key_announced_meanwhile_in_the_directory(redis_server, monkeypatch):
    """The directory lists a key that expired; A's GET finds nothing; B writes the key and its
    announcement reaches A's directory before A forgets the key: A must not then answer "absent" locally
    while Redis holds the answer (until a rescan, 10 min)."""
    fp = f"fp-{uuid.uuid4().hex[:8]}"
    directory = KeyDirectory(redis_server, exact_namespace(fp)).start()
    reader = ExactResponseCache(redis_server, fp, timeout_s=0.5, directory=directory)
    writer = ExactResponseCache(redis_server, fp, timeout_s=0.5)
    try:
        assert wait_for(lambda: directory.synced, 10)
        key = reader.key([3, 4], params())
        assert writer.put([3, 4], params(), final(4))
        assert wait_for(lambda: directory.contains(key), 5)
        writer.client.delete(key)  # its TTL ran out
        real_get = reader.client.get

        def get_then_other_replica_writes(k):
            value = real_get(k)
            monkeypatch.setattr(reader.client, "get", real_get)
            before = directory.adds
            assert writer.put([3, 4], params(), final(4))
            assert wait_for(lambda: directory.adds > before, 5)  # its announcement applied
            return value

        monkeypatch.setattr(reader.client, "get", get_then_other_replica_writes)
        assert reader.get([3, 4], params()) is None
        assert reader.get([3, 4], params()) == final(4), reader.snapshot()
    finally:
        reader.close()
        writer.close()


def test_semantic_lookup_of_a_lone_surrogate_prompt_is_uncacheable(redis_server):
    """`store` refuses a prompt UTF-8 cannot write; `lookup` counts it uncacheable rather than raise."""
    bad = "How do I reset my password\ud800?"
    cache = SemanticResponseCache(
        redis_server, f"fp-{uuid.uuid4().hex[:8]}", OneHotEmbedder({Q: unit(1), bad: unit(1)}), verifier=None
    )
    try:
        assert cache.store(Q, "t", params(), final(4))
        assert cache.lookup(bad, "t", params()) is None
        assert cache.snapshot()["uncacheable"] == 1
    finally:
        cache.close()
