"""Forgetting a tenant: its exact and semantic answers and its KV blocks go from Redis for every model;
nobody else's do."""

from __future__ import annotations

import io
import uuid

import pytest
import redis

from cache.redis_kv_store import RedisKVStore
from cache.response_cache import ExactResponseCache
from cache.semantic_cache import SemanticResponseCache
from cache.tenant_erasure import erase_tenant
from client.__main__ import main
from scheduler.messages import EngineRequestParams
from tests.test_redis_kv_store import META, _block, _keys
from tests.test_semantic_cache import GREEDY, QUESTION, embedder  # noqa: F401


def params(tenant: str) -> EngineRequestParams:
    return EngineRequestParams(max_tokens=32, tenant=tenant)


@pytest.fixture
def filled(redis_server, embedder):  # noqa: F811
    """Two models' exact caches and one semantic cache, each holding answers for tenants a and b (named
    afresh per test: the Redis is shared, and an erasure covers every model in it)."""
    run = uuid.uuid4().hex[:8]
    a, b = f"a-{run}", f"b-{run}"
    models = [f"fp-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    exact = [ExactResponseCache(redis_server, fp) for fp in models]
    semantic = SemanticResponseCache(redis_server, models[0], embedder, threshold=0.75)
    for cache in exact:
        for tenant in (a, b):
            assert cache.put([1, 2, 3], params(tenant), f"{tenant}'s answer")
    for tenant in (a, b):
        assert semantic.store(QUESTION, tenant, GREEDY, f"{tenant}'s semantic answer")
    kv = [RedisKVStore(redis_server, f"llm:kv:v1:{fp}") for fp in models]
    blocks = {tenant: _keys(3, tenant) for tenant in (a, b)}
    for store in kv:
        for tenant, keys in blocks.items():
            assert store.put_chain(keys, [_block(i) for i in range(3)], META, tenant=tenant) == 3
    yield exact, semantic, a, b, kv, blocks
    for cache in (*exact, semantic, *kv):
        cache.close()


def test_a_tenants_answers_are_deleted_for_every_model_and_only_its(redis_server, filled, monkeypatch):
    monkeypatch.setattr("cache.tenant_erasure.DELETE_BATCH", 1)  # every key a batch of its own
    exact, semantic, a, b, kv, blocks = filled
    client = redis.Redis.from_url(redis_server)
    dry = erase_tenant(client, a, dry_run=True)
    assert dry.keys == {"exact": 2, "semantic": 4, "l3": 6}  # 2 models; emb, doc, age, ver; 3 blocks each
    assert all(cache.get([1, 2, 3], params(a)) == f"{a}'s answer" for cache in exact)  # nothing deleted yet
    done = erase_tenant(client, a)
    assert done.keys == dry.keys and not done.dry_run
    for cache in exact:
        assert cache.get([1, 2, 3], params(a)) is None
        assert cache.get([1, 2, 3], params(b)) == f"{b}'s answer"
    assert semantic.lookup(QUESTION, a, GREEDY) is None
    assert semantic.lookup(QUESTION, b, GREEDY).answer == f"{b}'s semantic answer"
    for store in kv:
        assert store.get(blocks[a][0], META) is None
        assert store.get(blocks[b][0], META) is not None
    assert erase_tenant(client, a).keys == {"exact": 0, "semantic": 0, "l3": 0}
    assert not client.exists(kv[0].tenant_index(a)) and client.scard(kv[0].tenant_index(b)) == 3
    client.close()


class _WritesDuringErasure(redis.Redis):
    """A client whose first read of an index set lets an engine write one more of the tenant's blocks,
    under the model whose set is being read: `write(name of the set)`."""

    def __init__(self, url: str, write) -> None:
        super().__init__(connection_pool=redis.ConnectionPool.from_url(url))
        self.write = write

    def sscan_iter(self, name, *args, **kwargs):
        if self.write is not None:
            self.write, write = None, self.write
            write(name)
        yield from super().sscan_iter(name, *args, **kwargs)


def test_a_block_written_during_an_erasure_stays_listed_for_the_next_one(redis_server, filled):
    _, _, a, _, kv, blocks = filled
    late = _keys(1, a + "-late")
    during = []

    def write(index: bytes) -> None:
        store = next(store for store in kv if store.tenant_index(a).encode() in index)
        assert store.put_chain(late, [_block(0)], META, tenant=a) == 1
        during.append(store)

    client = _WritesDuringErasure(redis_server, write)
    assert erase_tenant(client, a).keys["l3"] == 6
    store = during[0]
    assert store.get(late[0], META) is not None and store.get(blocks[a][0], META) is None
    assert client.smembers(store.tenant_index(a)) == {store.redis_key(late[0]).encode()}
    assert erase_tenant(client, a).keys["l3"] == 1
    assert store.get(late[0], META) is None
    left = kv[1].tenant_index(a) + ":erasing:failed"  # an earlier erasure's set, stopped half-way
    client.sadd(left, kv[1].redis_key(late[0]))
    kv[1].put_chain(late, [_block(0)], META)
    assert erase_tenant(client, a, dry_run=True).keys["l3"] == 1
    assert erase_tenant(client, a).keys["l3"] == 1
    assert kv[1].get(late[0], META) is None
    assert not client.keys(kv[0].tenant_index(a) + "*") and not client.keys(kv[1].tenant_index(a) + "*")
    client.close()


def test_the_command_reports_what_it_deleted_and_refuses_an_empty_tenant(redis_server, filled):
    b = filled[3]
    out = io.StringIO()
    assert main(["forget-tenant", b, "--redis-url", redis_server, "--dry-run"], out=out) == 0
    assert "would delete 2 exact keys, 4 semantic keys, 6 l3 keys" in out.getvalue()
    out, err = io.StringIO(), io.StringIO()
    assert main(["forget-tenant", "", "--redis-url", redis_server], out=out, err=err) == 1
    assert "tenant is empty" in err.getvalue()
    assert main(["forget-tenant", b, "--redis-url", "redis://127.0.0.1:9/0"], out=out, err=err) == 1
