"""forget-tenant on a Redis Cluster whose slots are all on one master (a supported deployment: README
"Known limits", cache/redis_topology.py): the tenant's keys hash to many slots, and a cluster refuses a
multi-key command (UNLINK/EXISTS of a batch, RENAME of the index) across slots with CROSSSLOT."""

from __future__ import annotations

import io
import uuid

import redis

from cache.redis_kv_store import RedisKVStore
from cache.response_cache import ExactResponseCache
from cache.tenant_erasure import erase_tenant
from client.__main__ import main
from scheduler.messages import EngineRequestParams
from tests.conftest import answer
from tests.test_redis_kv_store import META, _block, _keys
from tests.test_redis_topology import one_master  # noqa: F401  (the fixture)


def test_forget_tenant_erases_a_tenant_on_a_one_master_cluster(one_master):  # noqa: F811
    run = uuid.uuid4().hex[:8]
    a, b = f"a-{run}", f"b-{run}"
    exact = ExactResponseCache(one_master, f"fp-{run}", timeout_s=0.5)
    store = RedisKVStore(one_master, f"llm:kv:v2:m-{run}", timeout_s=0.5)
    blocks = {t: _keys(3, t) for t in (a, b)}
    try:
        for t in (a, b):
            for i in range(3):
                assert exact.put([1, 2, i], EngineRequestParams(max_tokens=8, tenant=t), answer(f"{t}{i}"))
            assert store.put_chain(blocks[t], [_block(i) for i in range(3)], META, tenant=t) == 3
        out, err = io.StringIO(), io.StringIO()
        assert main(["forget-tenant", a, "--redis-url", one_master, "--dry-run"], out=out, err=err) == 0, (
            err.getvalue()
        )
        assert "would delete 3 exact keys, 0 semantic keys, 3 l3 keys" in out.getvalue()
        out, err = io.StringIO(), io.StringIO()
        assert main(["forget-tenant", a, "--redis-url", one_master], out=out, err=err) == 0, err.getvalue()
        assert "deleted 3 exact keys, 0 semantic keys, 3 l3 keys" in out.getvalue()
        for i in range(3):
            assert exact.get([1, 2, i], EngineRequestParams(max_tokens=8, tenant=a)) is None
            assert exact.get([1, 2, i], EngineRequestParams(max_tokens=8, tenant=b)) == answer(f"{b}{i}")
        assert store.get(blocks[a][0], META) is None and store.get(blocks[b][0], META) is not None
        client = redis.Redis.from_url(one_master)
        try:
            assert erase_tenant(client, a).keys == {"exact": 0, "semantic": 0, "l3": 0}
            assert not client.keys(store.tenant_index(a) + "*")
            assert client.zcard(store.tenant_index(b)) == 3
        finally:
            client.close()
    finally:
        exact.close()
        store.close()
