"""L3 KV store against a real redis-server: round trips, damaged values, dead and slow Redis, recovery."""

from __future__ import annotations

import hashlib
import socket
import time
import uuid

import struct

import pytest
import redis
import torch

from cache.circuit_breaker import BreakerState, CircuitBreaker
from cache.kv_format import KVBlockMeta
from cache.key_directory import KeyDirectory
from cache.redis_kv_store import RedisKVStore
from cache.tenant_erasure import erase_tenant
from tests.conftest import wait_for

SHAPE = (2, 2, 2, 16, 8)
META = KVBlockMeta(model_fingerprint="fp-a", dtype="bfloat16", shape=SHAPE, token_count=16, layout="L2HBD-v1")


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _keys(n: int, salt: str = "") -> list[bytes]:
    return [hashlib.sha256(f"{salt}{uuid.uuid4()}|{i}".encode()).digest() for i in range(n)]


def _block(seed: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


@pytest.fixture
def namespace() -> str:
    return f"test:kv:{uuid.uuid4().hex[:8]}"


@pytest.fixture
def raw(redis_server):
    client = redis.Redis.from_url(redis_server)
    yield client
    client.close()


@pytest.fixture(params=[False, True], ids=["raw", "zlib"])
def store(request, redis_server, namespace):
    s = RedisKVStore(redis_server, namespace, timeout_s=0.5, compress=request.param)
    yield s
    s.close()


def test_round_trip_and_ttl(store, raw):
    (key,) = _keys(1)
    block = _block(1)
    assert store.put(key, block, META)
    out = store.get(key, META)
    assert out is not None and torch.equal(out, block) and out.dtype == torch.bfloat16
    ttl = raw.ttl(store.redis_key(key))
    assert 24 * 3600 - 5 <= ttl <= 24 * 3600
    st = store.stats
    assert (st.stores, st.hits, st.misses) == (1, 1, 0)
    assert st.bytes_loaded == len(raw.get(store.redis_key(key))) and st.load_seconds > 0
    assert store.redis_key(key) == f"{store.namespace}:{key.hex()}"


def test_custom_ttl(redis_server, namespace, raw):
    store = RedisKVStore(redis_server, namespace, ttl_s=60, timeout_s=0.5)
    (key,) = _keys(1)
    assert store.put(key, _block(0), META)
    assert 55 <= raw.ttl(store.redis_key(key)) <= 60


def test_a_sub_second_ttl_is_a_second_not_ex_0(redis_server, namespace, raw):
    """EX 0 is refused by Redis: every write would fail and open the breaker, for reads too."""
    store = RedisKVStore(redis_server, namespace, ttl_s=0.5, timeout_s=0.5)
    (key,) = _keys(1)
    assert store.put(key, _block(0), META) and raw.ttl(store.redis_key(key)) == 1
    assert store.stats.errors == 0
    with pytest.raises(ValueError, match="positive"):
        RedisKVStore(redis_server, namespace, ttl_s=0)


def test_miss(store):
    assert store.get(_keys(1)[0], META) is None
    assert store.stats.misses == 1 and store.stats.hits == 0


def _damage(raw, name: str, how: str) -> None:
    value = bytearray(raw.get(name))
    if how == "flip":
        value[len(value) // 2] ^= 0x40
    elif how == "truncate":
        value = value[: len(value) - 7]
    else:  # a header of 60,000 "[": json.loads raises RecursionError, which must not escape as one
        header = b"[" * 60000
        value = bytearray(struct.pack("<4sHI", bytes(value[:4]), 1, len(header)) + header + bytes(16))
    raw.set(name, bytes(value))


@pytest.mark.parametrize("how", ["flip", "truncate", "nested"])
def test_damaged_value_is_rejected_deleted_and_counted(store, raw, how):
    (key,) = _keys(1)
    assert store.put(key, _block(2), META)
    _damage(raw, store.redis_key(key), how)
    assert store.get(key, META) is None
    assert store.stats.checksum_failures == 1
    assert raw.exists(store.redis_key(key)) == 0
    assert "CorruptValue" in (store.last_error or "")
    assert store.get(key, META) is None  # now a plain miss
    assert store.stats.checksum_failures == 1 and store.stats.misses == 1


def test_value_for_another_model_is_incompatible_and_deleted(store, raw):
    (key,) = _keys(1)
    other = KVBlockMeta("fp-b", META.dtype, META.shape, META.token_count, META.layout)
    assert store.put(key, _block(3), other)
    assert store.get(key, META) is None
    assert store.stats.incompatible == 1 and store.stats.checksum_failures == 0
    assert raw.exists(store.redis_key(key)) == 0


def test_discard_spares_a_value_rewritten_meanwhile(store, raw):
    (key,) = _keys(1)
    name = store.redis_key(key)
    assert store.put(key, _block(4), META)
    seen = raw.get(name)
    assert store.put(key, _block(5), META)  # another replica rewrote the block after our read
    assert not store.discard(name, seen)
    assert raw.exists(name) == 1
    assert store.discard(name, raw.get(name)) and raw.exists(name) == 0


def test_get_chain_returns_the_leading_valid_run(store, raw):
    keys = _keys(5)
    blocks = [_block(10 + i) for i in range(5)]
    assert store.put_chain(keys[:3], blocks[:3], META) == 3
    assert store.put(keys[4], blocks[4], META)
    out = store.get_chain(keys, META)
    assert len(out) == 3 and all(torch.equal(a, b) for a, b in zip(out, blocks))
    assert store.exists_chain(keys) == 3
    assert store.exists_each(keys) == [True, True, True, False, True]  # one script call, per key
    assert store.stats.misses == 1 and store.stats.hits == 3

    _damage(raw, store.redis_key(keys[1]), "flip")
    out = store.get_chain(keys, META)
    assert len(out) == 1 and torch.equal(out[0], blocks[0])
    assert store.stats.checksum_failures == 1
    assert raw.exists(store.redis_key(keys[1])) == 0 and raw.exists(store.redis_key(keys[2])) == 1
    assert store.exists_chain(keys) == 1
    assert store.get_chain([], META) == [] and store.exists_chain([]) == 0


def test_put_rejects_a_meta_that_does_not_fit(store):
    with pytest.raises(ValueError):
        store.put(_keys(1)[0], _block(0).float(), META)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _assert_fast_none(store: RedisKVStore, key: bytes) -> None:
    t0 = time.perf_counter()
    assert store.get(key, META) is None
    assert store.get_chain([key], META) == []
    assert store.exists_chain([key]) == 0
    assert not store.put(key, _block(0), META)
    assert time.perf_counter() - t0 < 4 * 0.5


def test_dead_redis_opens_the_breaker_then_recovers(tmp_path, namespace):
    from deploy.launch import start_redis_server

    port = _free_port()
    clock = FakeClock()
    breaker = CircuitBreaker(failure_threshold=3, reset_timeout_s=5.0, clock=clock)
    store = RedisKVStore(f"redis://127.0.0.1:{port}/0", namespace, timeout_s=0.05, breaker=breaker)
    (key,) = _keys(1)
    for _ in range(3):
        t0 = time.perf_counter()
        assert store.get(key, META) is None
        assert time.perf_counter() - t0 < 0.5
    assert breaker.state is BreakerState.OPEN
    assert store.stats.errors == 3
    _assert_fast_none(store, key)  # rejected by the breaker: no network at all
    assert store.stats.breaker_rejections == 4 and store.stats.errors == 3

    proc, _ = start_redis_server("redis-server", tmp_path, port)
    try:
        assert not store.put(key, _block(5), META)  # still open until the reset timeout
        clock.now += 5.0
        assert breaker.state is BreakerState.HALF_OPEN
        assert store.put(key, _block(5), META)  # the probe succeeds and closes the breaker
        assert breaker.state is BreakerState.CLOSED
        out = store.get(key, META)
        assert out is not None and torch.equal(out, _block(5))
        assert breaker.opens == 1
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        store.close()


def test_failed_probe_reopens(namespace):
    clock = FakeClock()
    breaker = CircuitBreaker(failure_threshold=1, reset_timeout_s=1.0, clock=clock)
    store = RedisKVStore(f"redis://127.0.0.1:{_free_port()}/0", namespace, breaker=breaker)
    (key,) = _keys(1)
    assert store.get(key, META) is None
    clock.now += 1.0
    assert store.get(key, META) is None  # the probe fails
    assert breaker.state is BreakerState.OPEN and breaker.opens == 2
    assert store.stats.errors == 2


def test_recovers_when_pointed_at_a_live_redis(redis_server, namespace):
    """Same breaker, store re-created against the live fixture (e.g. after a failover to a replica)."""
    clock = FakeClock()
    breaker = CircuitBreaker(failure_threshold=2, reset_timeout_s=5.0, clock=clock)
    dead = RedisKVStore(f"redis://127.0.0.1:{_free_port()}/0", namespace, breaker=breaker)
    (key,) = _keys(1)
    dead.get(key, META)
    dead.get(key, META)
    assert breaker.state is BreakerState.OPEN
    live = RedisKVStore(redis_server, namespace, breaker=breaker, timeout_s=0.5)
    assert live.get(key, META) is None and live.stats.breaker_rejections == 1
    clock.now += 5.0
    assert live.get(key, META) is None  # a miss, but a successful probe
    assert breaker.state is BreakerState.CLOSED


def test_slow_redis_times_out_quickly(namespace):
    """A server that accepts connections but never answers: each call costs one timeout, then none."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)  # the kernel completes handshakes; nobody ever replies
        port = listener.getsockname()[1]
        store = RedisKVStore(f"redis://127.0.0.1:{port}/0", namespace, timeout_s=0.05)
        (key,) = _keys(1)
        for _ in range(3):
            t0 = time.perf_counter()
            assert store.get(key, META) is None
            assert time.perf_counter() - t0 < 0.5
        assert store.breaker.state is BreakerState.OPEN
        assert store.stats.errors == 3
        t0 = time.perf_counter()
        assert not store.put(key, _block(0), META)
        assert time.perf_counter() - t0 < 0.05


def test_a_tenant_past_its_quota_pushes_out_its_own_oldest_blocks_not_another_tenants(
    redis_server, namespace, raw
):
    store = RedisKVStore(redis_server, namespace, timeout_s=0.5, tenant_max_blocks=4)
    try:
        quiet = _keys(3, "quiet")
        assert store.put_chain(quiet, [_block(i) for i in range(3)], META, tenant="quiet") == 3
        flood = _keys(20, "flood")
        for start in range(0, 20, 5):  # five blocks a write, oldest first: each write keeps its head four
            batch = flood[start : start + 5]
            assert store.put_chain(batch, [_block(i) for i in range(5)], META, tenant="flood") == 4
        assert all(raw.exists(store.redis_key(k)) for k in quiet), "the quiet tenant's blocks stay"
        present = [bool(raw.exists(store.redis_key(k))) for k in flood]
        assert present == [False] * 15 + [True] * 4 + [False], "the newest chain's head four, not its tail"
        assert raw.zcard(store.tenant_index("flood")) == 4 and raw.zcard(store.tenant_index("quiet")) == 3
        assert store.stats.quota_evictions == 16 and store.stats.stores == 23
        assert store.get_chain(quiet, META) and len(store.get_chain(quiet, META)) == 3
    finally:
        store.close()


def test_no_quota_by_default_and_a_negative_one_is_refused(redis_server, namespace, raw):
    store = RedisKVStore(redis_server, namespace, timeout_s=0.5)
    try:
        keys = _keys(6)
        assert store.put_chain(keys, [_block(i) for i in range(6)], META, tenant="t") == 6
        assert raw.zcard(store.tenant_index("t")) == 6 and store.stats.quota_evictions == 0
    finally:
        store.close()
    with pytest.raises(ValueError, match="tenant_max_blocks must be >= 0"):
        RedisKVStore(redis_server, namespace, tenant_max_blocks=-1)


def _commands(raw, command: str) -> int:
    return int(raw.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))


def test_a_quota_write_is_one_round_trip(redis_server, namespace, raw):
    """EVAL, not a registered script: from a pipeline, redis-py asks SCRIPT EXISTS before every send."""
    store = RedisKVStore(redis_server, namespace, timeout_s=0.5, tenant_max_blocks=4)
    try:
        before = _commands(raw, "script|exists") + _commands(raw, "script|load")
        for _ in range(5):
            assert store.put_chain(_keys(2), [_block(0), _block(1)], META, tenant="t") == 2
        assert _commands(raw, "script|exists") + _commands(raw, "script|load") == before
    finally:
        store.close()


def test_the_quota_keeps_a_head_that_newer_chains_extend(redis_server, namespace):
    """Written on reuse, a shared head (a system prompt) goes to Redis once and each continuation later in
    a write of its own: by write time alone the head would be the oldest and trimmed first, leaving
    continuations no lookup can reach. A continuation's write renews its head."""
    store = RedisKVStore(redis_server, namespace, timeout_s=0.5, tenant_max_blocks=4)
    try:
        head, a, b = _keys(2, "system-prompt"), _keys(2, "question-a"), _keys(2, "question-b")
        assert store.write_chain(head, [_block(0), _block(1)], META, "t").stored == 2
        assert store.write_chain(a, [_block(2), _block(3)], META, "t", head=head).evicted == []
        written = store.write_chain(b, [_block(4), _block(5)], META, "t", head=head)  # 6 > 4
        assert sorted(written.evicted) == sorted(a), "the older continuation goes, not the head"
        assert store.exists_chain(head + b) == 4
    finally:
        store.close()


def test_the_writers_directory_never_lists_what_the_quota_deleted(redis_server, namespace):
    """Names one write stores and its quota deletes at once are not announced: a directory thread a
    little behind would otherwise list them again after the writer discarded them."""
    directory = KeyDirectory(redis_server, namespace)
    real_apply = directory._apply
    directory._apply = lambda data: (time.sleep(0.2), real_apply(data))
    directory.start()
    store = RedisKVStore(redis_server, namespace, timeout_s=0.5, directory=directory, tenant_max_blocks=2)
    try:
        assert wait_for(lambda: directory.synced, 10)
        keys = _keys(5)
        assert store.put_chain(keys, [_block(i) for i in range(5)], META, tenant="t") == 2
        assert store.stats.quota_evictions == 3
        assert wait_for(lambda: directory.contains(store.redis_key(keys[0])), 10), "the kept are announced"
        time.sleep(0.4)  # any announcement of the deleted three would have been applied by now
        assert [directory.contains(store.redis_key(k)) for k in keys] == [True, True, False, False, False]
    finally:
        store.close()


def test_a_renewed_chain_is_trimmed_after_chains_used_longer_ago(redis_server, namespace, raw):
    store = RedisKVStore(redis_server, namespace, timeout_s=0.5, tenant_max_blocks=4)
    try:
        a, b, c = _keys(2, "a"), _keys(2, "b"), _keys(2, "c")
        for keys in (a, b):
            assert store.put_chain(keys, [_block(0), _block(1)], META, tenant="t") == 2
        time.sleep(0.01)
        assert store.renew(a, "t") and store.stats.renewals == 1  # a was read: it is the recent one now
        written = store.write_chain(c, [_block(2), _block(3)], META, "t")
        assert sorted(written.evicted) == sorted(b) and store.exists_chain(a) == 2
        assert 24 * 3600 - 5 <= raw.ttl(store.redis_key(a[0])) <= 24 * 3600
        assert store.renew(_keys(2, "gone"), "t")  # names Redis does not hold: not added to the index
        assert raw.zcard(store.tenant_index("t")) == 4
    finally:
        store.close()
    free = RedisKVStore(redis_server, namespace, timeout_s=0.5)
    try:
        assert not free.renew(a, "t"), "no quota: nothing to renew"
    finally:
        free.close()


def _quota_store(redis_server, namespace):
    return RedisKVStore(redis_server, namespace, timeout_s=0.5, tenant_max_blocks=100)


def test_a_renewal_keeps_the_index_alive_as_long_as_the_blocks_it_renews(redis_server, namespace, raw):
    """Else a tenant that only reuses its blocks keeps them alive past its index, and forget-tenant, which
    finds a tenant's blocks through that index, misses them."""
    store, tenant = _quota_store(redis_server, namespace), f"renewed-{uuid.uuid4().hex[:8]}"
    try:
        keys = _keys(2)
        assert store.put_chain(keys, [_block(0), _block(1)], META, tenant=tenant) == 2
        index, names = store.tenant_index(tenant), [store.redis_key(k) for k in keys]
        for name in [index, *names]:  # ~24 h after the tenant's last write
            raw.pexpire(name, 300)
        assert store.renew(keys, tenant)
        assert min(raw.ttl(name) for name in names) > 100 and raw.ttl(index) >= max(raw.ttl(n) for n in names)
        time.sleep(0.6)  # anything left at the old TTL is gone now
        assert erase_tenant(raw, tenant).keys["l3"] == 2 and not any(raw.exists(name) for name in names)
    finally:
        store.close()


def test_a_renewal_leaves_alone_names_the_index_does_not_list(redis_server, namespace, raw):
    store = _quota_store(redis_server, namespace)
    try:
        keys = _keys(2)
        assert store.put_chain(keys, [_block(0), _block(1)], META, tenant="t") == 2
        index, names = store.tenant_index("t"), [store.redis_key(k) for k in keys]
        raw.zrem(index, *names)  # pruned, or the index lost
        for name in names:
            raw.expire(name, 100)
        assert store.renew(keys, "t")
        assert raw.zcard(index) == 0 and all(raw.ttl(name) <= 100 for name in names)
    finally:
        store.close()


def test_a_value_under_another_blocks_name_is_refused_and_deleted(store, raw):
    """Tenant A's block copied under tenant B's block name (a restore of the wrong snapshot, a manual
    COPY): the value names the block key it was written for, so B's lookup refuses it."""
    key_a, key_b = _keys(2)
    assert store.put_chain([key_a], [_block(7)], META, tenant="tenant-a") == 1
    raw.set(store.redis_key(key_b), raw.get(store.redis_key(key_a)))
    assert store.get_chain([key_b], META) == []
    assert store.stats.incompatible == 1 and raw.exists(store.redis_key(key_b)) == 0
    assert len(store.get_chain([key_a], META)) == 1


def test_a_block_name_holding_another_type_is_deleted_and_counted(store, raw):
    """A hash under a block's name: the probe (EXISTS) says it is there and MGET reads nothing, so each
    lookup of the chain would pay for a load; the load that finds it so deletes it."""
    keys = _keys(2)
    assert store.put_chain(keys, [_block(0), _block(1)], META) == 2
    name = store.redis_key(keys[0])
    raw.delete(name)
    raw.hset(name, "x", "y")
    assert store.exists_chain(keys) == 2
    assert store.get_chain(keys, META) == []
    assert raw.exists(name) == 0 and store.stats.checksum_failures == 1
    assert store.exists_chain(keys) == 0
    assert store.get_chain(keys, META) == [] and store.stats.checksum_failures == 1  # a plain miss now


@pytest.mark.parametrize("quota", [0, 4])
def test_a_tenant_index_holding_another_type_is_rebuilt_by_the_next_write(
    redis_server, namespace, raw, quota
):
    """A string under a tenant's index: ZADD fails inside the write's pipeline, while EXPIRE would keep
    the bad key alive; the tenant's blocks would be listed nowhere (forget-tenant misses them) and the
    quota would never trim again. The write deletes it and lists its blocks afresh."""
    store = RedisKVStore(redis_server, namespace, timeout_s=0.5, tenant_max_blocks=quota)
    try:
        index = store.tenant_index("t")
        raw.set(index, b"garbage")
        chains = [_keys(4) for _ in range(3)]
        for keys in chains:
            assert store.put_chain(keys, [_block(i) for i in range(4)], META, tenant="t") == 4
        assert raw.type(index) == b"zset" and store.stats.bad_indexes == 1 and store.stats.errors == 0
        listed = {name.decode() for name in raw.zrange(index, 0, -1)}
        held = {store.redis_key(k) for keys in chains for k in keys if raw.exists(store.redis_key(k))}
        assert listed == held and len(held) == (quota or 12)
    finally:
        store.close()


def test_one_tenants_damaged_index_does_not_open_the_breaker_for_the_others(redis_server, namespace, raw):
    """Renewals of a tenant whose index holds another type: the script deletes that index instead of
    answering WRONGTYPE, which would count as Redis failing and open the breaker for every tenant."""
    store = RedisKVStore(redis_server, namespace, timeout_s=0.5, tenant_max_blocks=100)
    try:
        b_keys, a_keys = _keys(2), _keys(2)
        assert store.put_chain(b_keys, [_block(0), _block(1)], META, tenant="b") == 2
        assert store.put_chain(a_keys, [_block(2), _block(3)], META, tenant="a") == 2
        raw.delete(store.tenant_index("a"))
        raw.set(store.tenant_index("a"), b"garbage")
        assert not store.renew(a_keys, "a")
        assert raw.exists(store.tenant_index("a")) == 0 and store.stats.bad_indexes == 1
        for _ in range(3):
            store.renew(a_keys, "a")
        assert len(store.get_chain(b_keys, META)) == 2 and store.stats.errors == 0
    finally:
        store.close()
