"""A key Redis holds must never be answered "absent" by the key directory (found in review, 2026-12-07).

Every discard that follows a round trip must be skipped when a write of the name was announced (and
applied) since that round trip went out, as `get_chain`'s and `get`'s miss paths already do with the
`adds` stamp. These four paths discard unconditionally after a delete (DELETE_IF_UNCHANGED, DROP_OTHER_TYPE
or a tenant quota's trim): another replica's write of the same name that lands right after the delete,
and whose announcement the directory applies before the discard, is then hidden from this replica until the
next rescan (10 minutes), its lookups answered "absent" without asking Redis."""

from __future__ import annotations

import hashlib
import uuid

import pytest
import redis
import torch

import cache.redis_kv_store as kv_module
import cache.response_cache as rc_module
from cache.key_directory import KeyDirectory
from cache.kv_format import KVBlockMeta
from cache.redis_kv_store import RedisKVStore
from cache.response_cache import ExactResponseCache, exact_namespace
from engine.kv_tiers import LAYOUT
from scheduler.messages import EngineRequestParams
from tests.conftest import answer, wait_for

META = KVBlockMeta("fp", "float32", (1, 2, 1, 4, 2), 4, LAYOUT)
GREEDY = EngineRequestParams(max_tokens=8, temperature=0.0, tenant="tenant-a")


def _block(i: int) -> torch.Tensor:
    return torch.full((1, 2, 1, 4, 2), float(i))


@pytest.fixture
def raw(redis_server):
    client = redis.Redis.from_url(redis_server)
    yield client
    client.close()


def started(url: str, namespace: str) -> KeyDirectory:
    directory = KeyDirectory(url, namespace).start()
    assert wait_for(lambda: directory.synced, 10), "the directory never synced"
    return directory


def applied(directory: KeyDirectory, raw: redis.Redis) -> None:
    """Wait until `directory` has applied every announcement published so far: a marker sent behind them
    (one channel's messages arrive in order) is listed."""
    marker = f"{directory.namespace}:marker-{uuid.uuid4().hex}"
    raw.publish(directory.channel, marker)
    assert wait_for(lambda: directory.contains(marker) is True, 5)


@pytest.fixture
def kv(redis_server):
    namespace = f"test:kdrace:{uuid.uuid4().hex[:8]}"
    made = []

    def store(**options) -> RedisKVStore:
        made.append(RedisKVStore(redis_server, namespace, timeout_s=0.5, **options))
        return made[-1]

    yield namespace, store
    for s in made:
        s.close()


@pytest.mark.parametrize(
    ("damage", "deleting_script"),
    [
        (lambda raw, name: raw.set(name, b"damaged value"), "_delete_if_unchanged"),
        # another type under a block's name: MGET reads it as missing
        (lambda raw, name: raw.hset(name, "f", "v"), "_drop_other_type"),
    ],
    ids=["damaged", "wrong-type"],
)
def test_a_bad_block_rewritten_right_after_its_delete_stays_listed(
    redis_server, raw, kv, damage, deleting_script
):
    namespace, store = kv
    reader = store(directory=started(redis_server, namespace))
    writer = store()
    key = hashlib.sha256(uuid.uuid4().bytes).digest()
    name = reader.redis_key(key)
    damage(raw, name)
    real = getattr(reader, deleting_script)

    def delete_then_another_replica_writes(**kwargs):
        reply = real(**kwargs)  # the bad value is deleted
        assert writer.put(key, _block(1), META)  # another replica writes the good block now
        assert wait_for(lambda: reader.directory.contains(name) is True, 5)  # its announcement applied
        return reply

    setattr(reader, deleting_script, delete_then_another_replica_writes)
    assert reader.get(key, META) is None and reader.stats.checksum_failures == 1
    assert raw.exists(name) == 1
    assert reader.directory.contains(name) is not False, "directory says 'absent' for a block Redis holds"
    assert reader.exists_chain([key]) == 1


def test_a_block_the_quota_evicted_and_another_replica_rewrote_stays_listed(
    redis_server, raw, kv, monkeypatch
):
    namespace, store = kv
    reader = store(directory=started(redis_server, namespace), tenant_max_blocks=1)
    other = store(tenant_max_blocks=2)  # another replica (configured higher, a rolling update)
    a, b = (hashlib.sha256(uuid.uuid4().bytes).digest() for _ in range(2))
    assert reader.put_chain([a], [_block(1)], META, tenant="t") == 1
    real = kv_module.write_announced

    def trim_then_another_replica_writes(*args, **kwargs):
        written = real(*args, **kwargs)  # writes b; the quota deletes a
        if written.evicted:
            assert other.put_chain([a], [_block(1)], META, tenant="t") == 1  # a written again at once
            applied(reader.directory, raw)  # and its announcement applied by the reader's directory
        return written

    monkeypatch.setattr(kv_module, "write_announced", trim_then_another_replica_writes)
    written = reader.write_chain([b], [_block(2)], META, "t")
    assert written.evicted == [a]
    name = reader.redis_key(a)
    assert raw.exists(name) == 1
    assert reader.directory.contains(name) is not False, "directory says 'absent' for a block Redis holds"


def test_a_tampered_answer_rewritten_right_after_its_delete_stays_listed(redis_server, raw):
    fp = f"fp-kdrace-{uuid.uuid4().hex[:6]}"
    cache = ExactResponseCache(
        redis_server, fp, timeout_s=0.5, directory=started(redis_server, exact_namespace(fp))
    )
    other = ExactResponseCache(redis_server, fp, timeout_s=0.5)
    prompt = [int(x) for x in uuid.uuid4().bytes]
    key = cache.key(prompt, GREEDY)
    try:
        raw.set(key, b'{"v":1,"text":"tampered","sum":"0"}')
        cache.directory.add([key])  # listed (its write was announced before it was damaged)
        real = cache._delete_if_unchanged

        def delete_then_another_replica_writes(**kwargs):
            reply = real(**kwargs)
            assert other.put(prompt, GREEDY, answer("a good answer"))
            applied(cache.directory, raw)
            return reply

        cache._delete_if_unchanged = delete_then_another_replica_writes
        assert cache.get(prompt, GREEDY) is None and cache.stats.corrupt == 1
        cache._delete_if_unchanged = real
        assert raw.exists(key) == 1
        assert cache.directory.contains(key) is not False, "directory says 'absent' for an answer Redis holds"
        assert cache.get(prompt, GREEDY) == answer("a good answer")
    finally:
        cache.close()
        other.close()


def test_an_answer_the_quota_evicted_and_another_replica_rewrote_stays_listed(redis_server, raw, monkeypatch):
    fp = f"fp-kdrace-{uuid.uuid4().hex[:6]}"
    directory = started(redis_server, exact_namespace(fp))
    cache = ExactResponseCache(redis_server, fp, timeout_s=0.5, directory=directory, tenant_max_entries=1)
    other = ExactResponseCache(redis_server, fp, timeout_s=0.5, tenant_max_entries=2)
    first, second = ([int(x) for x in uuid.uuid4().bytes] for _ in range(2))
    first_key = cache.key(first, GREEDY)
    try:
        assert cache.put(first, GREEDY, answer("first"))
        real = rc_module.write_announced

        def trim_then_another_replica_writes(*args, **kwargs):
            written = real(*args, **kwargs)
            if written.evicted:
                assert other.put(first, GREEDY, answer("first"))
                applied(directory, raw)
            return written

        monkeypatch.setattr(rc_module, "write_announced", trim_then_another_replica_writes)
        assert cache.put(second, GREEDY, answer("second"))
        assert cache.stats.quota_evictions == 1
        assert raw.exists(first_key) == 1
        assert directory.contains(first_key) is not False, "directory says 'absent' for an answer Redis holds"
        monkeypatch.undo()
        assert cache.get(first, GREEDY) == answer("first")
    finally:
        cache.close()
        other.close()
