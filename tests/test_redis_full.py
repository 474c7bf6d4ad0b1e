"""A full Redis, or a read-only replica, refuses writes but still serves reads: the caches pause their
writes and keep reading, and the Redis this project starts evicts cache values (TTL) at its bound instead
of refusing."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator

import pytest
import redis
import torch

from cache.circuit_breaker import BreakerState, CircuitBreaker
from cache.redis_full import FullGate, is_out_of_memory, is_read_only
from cache.redis_kv_store import RedisKVStore
from cache.response_cache import ExactResponseCache
from deploy.launch import find_free_port, start_redis_server
from scheduler.messages import EngineRequestParams
from tests.test_redis_kv_store import META, FakeClock, _block, _keys
from tests.conftest import answer

OOM = redis.exceptions.OutOfMemoryError("command not allowed when used memory > 'maxmemory'.")
GREEDY = EngineRequestParams(max_tokens=8)


def test_a_refusal_for_memory_pauses_writes_and_nothing_else_does():
    clock = FakeClock()
    gate = FullGate(pause_s=1.0, clock=clock)
    assert not gate.refused(redis.exceptions.ResponseError("ERR wrong number of arguments"))
    assert not gate.refused(redis.exceptions.ConnectionError("refused")) and gate.allow()
    assert gate.refused(OOM)
    assert not gate.allow() and not gate.allow()
    clock.now = 1.0
    assert gate.allow()
    assert (gate.refusals, gate.skips) == (1, 2)


def test_out_of_memory_is_recognized_in_a_scripts_error_too():
    assert is_out_of_memory(OOM)
    wrapped = redis.exceptions.ResponseError("Error in script: OOM command not allowed when used memory > x")
    assert is_out_of_memory(wrapped)
    assert not is_out_of_memory(redis.exceptions.ResponseError("NOSCRIPT No matching script"))
    assert not is_out_of_memory(TimeoutError("command not allowed when used memory"))  # not a reply


def test_a_read_only_replica_pauses_writes_and_is_counted_apart():
    clock = FakeClock()
    gate = FullGate(pause_s=1.0, clock=clock)
    assert gate.refused(redis.exceptions.ReadOnlyError("You can't write against a read only replica."))
    assert not gate.allow()
    clock.now = 1.0
    assert gate.allow()
    assert (gate.refusals, gate.readonly_refusals, gate.skips) == (0, 1, 1)
    wrapped = redis.exceptions.ResponseError(
        "Error in script: READONLY You can't write against a read only replica. script: abc"
    )
    assert is_read_only(wrapped) and not is_out_of_memory(wrapped)
    assert not is_read_only(redis.exceptions.ResponseError("WRONGTYPE Operation against a key"))


@contextlib.contextmanager
def own_redis(tmp_path, **options: str) -> Iterator[tuple[str, redis.Redis]]:
    """A redis-server of the test's own, started as the launcher starts one; (url, client)."""
    port = find_free_port()
    proc, _ = start_redis_server("redis-server", tmp_path, port, **options)
    url = f"redis://localhost:{port}/0"
    client = redis.Redis.from_url(url)
    try:
        yield url, client
    finally:
        client.close()
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture
def replica_redis(tmp_path):
    """To be turned into a replica of a master that never answers: reads work, writes answer READONLY (a
    cache's Redis after a failover pointed it elsewhere)."""
    with own_redis(tmp_path) as server:
        yield server


def _make_replica(client: redis.Redis) -> None:
    client.execute_command("REPLICAOF", "127.0.0.1", str(find_free_port()))
    with pytest.raises(redis.exceptions.ReadOnlyError):
        client.set("probe", b"x")


def test_a_read_only_replica_refuses_answers_and_blocks_yet_serves_the_cached_ones(replica_redis):
    url, client = replica_redis
    fingerprint = f"fp-{uuid.uuid4().hex[:8]}"
    cache = ExactResponseCache(url, fingerprint=fingerprint, timeout_s=0.5, tenant_max_entries=8)
    store = RedisKVStore(url, f"test:kv:{uuid.uuid4().hex[:8]}", timeout_s=0.5, tenant_max_blocks=8)
    try:
        kept = _keys(1)
        assert cache.put([1, 2, 3], GREEDY, answer("kept before the failover"))
        assert store.put_chain(kept, [_block(1)], META, tenant="acme") == 1
        _make_replica(client)
        for i in range(6):  # more than the breaker's failure threshold, with the writer's renewals
            assert not cache.put([9, i], GREEDY, answer("refused"))
            assert store.put_chain(_keys(1), [_block(2)], META, tenant="acme") == 0
            cache.full.clock = store.full.clock = lambda: 1e9 + i * 10  # each write past the last pause
            store.renew(kept, "acme")
        assert cache.get([1, 2, 3], GREEDY) == answer("kept before the failover")
        torch.testing.assert_close(store.get(kept[0], META), _block(1))
        assert cache.snapshot()["readonly_refusals"] >= 1 and cache.snapshot()["errors"] == 0
        stats = store.stats
        assert stats.readonly_refusals >= 6 and (stats.errors, stats.breaker_rejections) == (0, 0)
    finally:
        cache.close()
        store.close()


@pytest.fixture
def small_redis(tmp_path):
    """A Redis of 4 MB of its own."""
    with own_redis(tmp_path, maxmemory="4mb") as server:
        yield server


def _fill(client: redis.Redis) -> None:
    """Past maxmemory with values that have no TTL, which no policy may evict: 6 MB written unbounded,
    then the bound put back under them."""
    client.config_set("maxmemory", "0")
    for i in range(6):
        client.set(f"ballast:{i}", b"x" * 2**20)
    client.config_set("maxmemory-policy", "noeviction")  # first: a volatile policy would evict cache values
    client.config_set("maxmemory", "4mb")
    with pytest.raises(redis.exceptions.OutOfMemoryError):
        client.set("probe", b"y")


def test_a_full_redis_refuses_an_exact_answer_yet_still_serves_the_cached_ones(small_redis):
    url, client = small_redis
    cache = ExactResponseCache(url, fingerprint=f"fp-{uuid.uuid4().hex[:8]}", timeout_s=0.5)
    try:
        assert cache.put([1, 2, 3], GREEDY, answer("kept before the fill"))
        _fill(client)
        for i in range(6):  # more than the breaker's failure threshold
            assert not cache.put([9, i], GREEDY, answer("no room"))
        assert cache.get([1, 2, 3], GREEDY) == answer("kept before the fill")  # the breaker did not open
        stats = cache.snapshot()
        assert (stats["full_refusals"], stats["full_skips"], stats["errors"]) == (1, 5, 0)
        assert cache.breaker.allow()
    finally:
        cache.close()


def test_a_full_redis_refuses_kv_blocks_without_opening_the_breaker(small_redis):
    url, client = small_redis
    store = RedisKVStore(url, f"test:kv:{uuid.uuid4().hex[:8]}", timeout_s=0.5)
    try:
        kept = _keys(1)
        assert store.put_chain(kept, [_block(1)], META) == 1
        _fill(client)
        for _ in range(6):
            assert store.put_chain(_keys(2), [_block(2), _block(3)], META) == 0
        torch.testing.assert_close(store.get(kept[0], META), _block(1))
        stats = store.stats
        assert (stats.full_refusals, stats.full_skips, stats.errors, stats.breaker_rejections) == (1, 5, 0, 0)
    finally:
        store.close()


def test_a_paused_write_leaves_the_breakers_probe_and_a_refusal_closes_it(small_redis):
    """Half-open after an outage: a write skipped by the pause must not take the one probe (reads would
    wait out another period), and a refusal for memory is Redis answering, so it closes the breaker."""
    url, client = small_redis
    clock = FakeClock()
    breaker = CircuitBreaker(failure_threshold=1, reset_timeout_s=5.0, clock=clock)
    cache = ExactResponseCache(url, fingerprint=f"fp-{uuid.uuid4().hex[:8]}", timeout_s=0.5, breaker=breaker)
    store = RedisKVStore(url, f"test:kv:{uuid.uuid4().hex[:8]}", timeout_s=0.5, breaker=breaker)
    try:
        _fill(client)
        breaker.record_failure()  # an outage opens it at 0
        clock.now = 5.0  # half-open: one probe may go; writes paused by an earlier refusal
        for gate in (cache.full, store.full):
            gate.clock = clock
            assert gate.refused(OOM)
        assert (
            not cache.put([9, 1], GREEDY, answer("paused"))
            and store.put_chain(_keys(1), [_block(1)], META) == 0
        )
        assert breaker.allow()  # the probe was still there
        breaker.record_failure()
        clock.now = 10.0  # half-open again, the pause over: this write is the probe, and Redis refuses it
        assert not cache.put([9, 2], GREEDY, answer("refused"))
        assert breaker.state is BreakerState.CLOSED
        clock.now = 16.0
        breaker.record_failure()
        clock.now = 21.0
        assert store.put_chain(_keys(1), [_block(1)], META) == 0 and breaker.state is BreakerState.CLOSED
    finally:
        cache.close()
        store.close()


def test_the_redis_this_project_starts_evicts_cache_values_and_keeps_the_traffic_history(small_redis):
    url, client = small_redis
    client.set("llm:traffic:history", b"h" * 1024)  # no TTL, as the warmup planner's history
    store = RedisKVStore(url, f"test:kv:{uuid.uuid4().hex[:8]}", timeout_s=0.5)
    try:
        blocks = [_block(i) for i in range(8)]
        written = sum(store.put_chain(_keys(8), blocks, META) for _ in range(500))  # ~10 MB, past the bound
        assert written == 4000 and store.stats.full_refusals == 0
        assert client.dbsize() < 4000  # the oldest blocks were evicted to make room
        assert client.get("llm:traffic:history") == b"h" * 1024
        assert client.config_get("maxmemory-policy")["maxmemory-policy"] == "volatile-lru"
    finally:
        store.close()
