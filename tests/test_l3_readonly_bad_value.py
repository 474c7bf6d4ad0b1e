"""A read-only replica (after a failover) holding a damaged L3 block: the reader's delete of it is refused
(READONLY). That is Redis answering, a write refused, as cache/redis_full.py says: it must not count as a
Redis error nor as a breaker failure."""

from __future__ import annotations

import torch

from cache.circuit_breaker import BreakerState
from cache.redis_kv_store import RedisKVStore
from tests.test_redis_full import _make_replica, own_redis
from tests.test_redis_kv_store import META, _block, _damage, _keys


def test_a_damaged_block_on_a_read_only_replica_is_no_redis_error_nor_breaker_failure(tmp_path):
    with own_redis(tmp_path) as (url, client):
        store = RedisKVStore(url, "test:kv:ro-damaged", timeout_s=0.5)
        try:
            good, bad = _keys(1), _keys(1)
            assert store.put(good[0], _block(1), META) and store.put(bad[0], _block(2), META)
            _damage(client, store.redis_key(bad[0]), "flip")
            _make_replica(client)
            for _ in range(4):  # every lookup of its chain finds it again: it cannot be deleted
                assert store.get(bad[0], META) is None
            stats = store.stats
            assert stats.checksum_failures == 4
            assert (stats.errors, store.breaker.failures) == (0, 0), store.last_error
            assert stats.readonly_refusals >= 1
            assert store.breaker.state is BreakerState.CLOSED
            out = store.get(good[0], META)  # the replica still serves what it holds
            assert out is not None and torch.equal(out, _block(1))
        finally:
            store.close()
