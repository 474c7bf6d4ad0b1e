"""L3 on a Redis Cluster whose one master serves every slot (a supported topology, cache/redis_topology.py):
a chain's blocks hash to different slots, and Redis refuses a multi-key command across slots (CROSSSLOT)
even on one node, so chain reads, probes and quota writes go one command per slot."""

from __future__ import annotations

import uuid

import torch

from cache.redis_kv_store import RedisKVStore
from tests.test_redis_kv_store import META, _block, _keys
from tests.test_redis_topology import one_master  # noqa: F401  (the fixture)


def test_a_chain_of_blocks_is_written_read_and_probed_on_a_one_master_cluster(one_master):  # noqa: F811
    for quota in (0, 3):
        store = RedisKVStore(
            one_master, f"test:kv:{uuid.uuid4().hex[:8]}", timeout_s=0.5, tenant_max_blocks=quota
        )
        try:
            keys = _keys(3)
            assert store.put_chain(keys, [_block(i) for i in range(3)], META, tenant="t") == 3
            assert store.exists_each_in_redis(keys + _keys(1)) == [True, True, True, False], store.last_error
            blocks = store.get_chain(keys, META)
            assert len(blocks) == 3
            for i, block in enumerate(blocks):
                torch.testing.assert_close(block, _block(i))
            assert store.stats.errors == 0, store.last_error
        finally:
            store.close()


def test_a_tenant_quota_trims_on_a_one_master_cluster(one_master):  # noqa: F811
    """The quota's script deletes names it is given as arguments, in other slots than its index's."""
    store = RedisKVStore(one_master, f"test:kv:{uuid.uuid4().hex[:8]}", timeout_s=0.5, tenant_max_blocks=2)
    try:
        keys = _keys(3)
        written = store.write_chain(keys, [_block(i) for i in range(3)], META, tenant="t")
        assert written.stored == 3 and len(written.evicted) == 1, store.last_error
        assert store.exists_each_in_redis(keys).count(True) == 2 and store.stats.errors == 0
    finally:
        store.close()
