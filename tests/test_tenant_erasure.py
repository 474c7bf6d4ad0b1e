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
from tests.conftest import answer


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
            assert cache.put([1, 2, 3], params(tenant), answer(f"{tenant}'s answer"))
    for tenant in (a, b):
        assert semantic.store(QUESTION, tenant, GREEDY, answer(f"{tenant}'s semantic answer"))
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
    assert all(
        cache.get([1, 2, 3], params(a)) == answer(f"{a}'s answer") for cache in exact
    )  # nothing deleted yet
    done = erase_tenant(client, a)
    assert done.keys == dry.keys and not done.dry_run
    for cache in exact:
        assert cache.get([1, 2, 3], params(a)) is None
        assert cache.get([1, 2, 3], params(b)) == answer(f"{b}'s answer")
    assert semantic.lookup(QUESTION, a, GREEDY) is None
    assert semantic.lookup(QUESTION, b, GREEDY).answer == answer(f"{b}'s semantic answer")
    for store in kv:
        assert store.get(blocks[a][0], META) is None
        assert store.get(blocks[b][0], META) is not None
    assert erase_tenant(client, a).keys == {"exact": 0, "semantic": 0, "l3": 0}
    assert not client.exists(kv[0].tenant_index(a)) and client.zcard(kv[0].tenant_index(b)) == 3
    client.close()


class _WritesDuringErasure(redis.Redis):
    """A client whose first read of an index set lets an engine write one more of the tenant's blocks,
    under the model whose set is being read: `write(name of the set)`."""

    def __init__(self, url: str, write) -> None:
        super().__init__(connection_pool=redis.ConnectionPool.from_url(url))
        self.write = write

    def zscan_iter(self, name, *args, **kwargs):
        if self.write is not None:
            self.write, write = None, self.write
            write(name)
        yield from super().zscan_iter(name, *args, **kwargs)


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
    assert client.zrange(store.tenant_index(a), 0, -1) == [store.redis_key(late[0]).encode()]
    assert erase_tenant(client, a).keys["l3"] == 1
    assert store.get(late[0], META) is None
    left = kv[1].tenant_index(a) + ":erasing:failed"  # an earlier erasure's index, stopped half-way
    client.zadd(left, {kv[1].redis_key(late[0]): 0})
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


def test_a_tenants_index_lists_what_redis_still_holds_not_every_block_it_ever_wrote(
    redis_server, monkeypatch
):
    """Names whose blocks expired leave the index on the tenant's next write: an active tenant's index
    stays as large as what it holds, instead of growing for as long as it writes."""
    import cache.key_directory as key_directory

    store = RedisKVStore(redis_server, f"test:kv:{uuid.uuid4().hex[:8]}", ttl_s=60, timeout_s=0.5)
    now = [1_000_000.0]
    monkeypatch.setattr(key_directory.time, "time", lambda: now[0])
    old, new = _keys(3, "old"), _keys(2, "new")
    assert store.put_chain(old, [_block(i) for i in range(3)], META, tenant="t") == 3
    now[0] += 60 + key_directory.INDEX_CLOCK_MARGIN_S + 1  # the old blocks' TTL (and the margin) went by
    assert store.put_chain(new, [_block(i) for i in range(2)], META, tenant="t") == 2
    listed = set(store.client.zrange(store.tenant_index("t"), 0, -1))
    assert listed == {store.redis_key(k).encode() for k in new}
    store.close()


def test_an_index_written_as_a_plain_set_before_is_still_erased(redis_server):
    from cache.redis_kv_store import LEGACY_TENANT_INDEX_PREFIX, TENANT_INDEX_PREFIX

    store = RedisKVStore(redis_server, f"test:kv:{uuid.uuid4().hex[:8]}", timeout_s=0.5)
    tenant = f"legacy-{uuid.uuid4().hex[:6]}"
    keys = _keys(2, tenant)
    assert store.put_chain(keys, [_block(0), _block(1)], META) == 2  # no tenant: no index written
    legacy = store.tenant_index(tenant).replace(TENANT_INDEX_PREFIX, LEGACY_TENANT_INDEX_PREFIX, 1)
    store.client.sadd(legacy, *[store.redis_key(k) for k in keys])
    client = redis.Redis.from_url(redis_server)
    assert erase_tenant(client, tenant).keys["l3"] == 2
    assert store.get(keys[0], META) is None and not client.exists(legacy)
    client.close()
    store.close()


def test_entries_of_the_earlier_key_formats_are_erased_too(redis_server):
    """v1 and v2 exact and semantic entries are never read again but hold the tenant's answers until
    their TTL.
    Named as the earlier code named them: the semantic ones in a hash tag, `{<fp>:<tag>}` (a pattern written
    for `:<tag>:` matched none of them; found in review)."""
    from cache.response_cache import tenant_tag

    client = redis.Redis.from_url(redis_server)
    tenant, other = f"old-{uuid.uuid4().hex[:6]}", f"keep-{uuid.uuid4().hex[:6]}"
    fp = "0123456789abcdef|fedcba9876543210|float32|slot-kv-v1"

    def old_names(t: str) -> list[str]:
        exact = [f"llm:resp:exact:{version}:{fp}:{tenant_tag(t)}:abc" for version in ("v1", "v2")]
        semantic = [f"llm:resp:sem:{version}:{{{fp}:{tenant_tag(t)}}}" for version in ("v1", "v2")]
        return exact + [f"{prefix}:{k}" for prefix in semantic for k in ("emb", "doc", "age", "ver")]

    mine, theirs = old_names(tenant), old_names(other)
    for key in [*mine, *theirs]:
        client.set(key, b"an old answer", ex=600)
    assert erase_tenant(client, tenant).keys == {"exact": 2, "semantic": 8, "l3": 0}
    assert not client.exists(*mine) and client.exists(*theirs) == len(theirs)
    client.close()


def test_an_exact_quotas_index_goes_with_the_tenants_answers(redis_server):
    run = uuid.uuid4().hex[:8]
    a, b = f"a-{run}", f"b-{run}"
    cache = ExactResponseCache(redis_server, f"fp-{run}", tenant_max_entries=5)
    client = redis.Redis.from_url(redis_server)
    try:
        for tenant in (a, b):
            assert cache.put([1, 2, 3], params(tenant), answer(f"{tenant}'s answer"))
        assert erase_tenant(client, a).keys["exact"] == 2  # the answer and the quota's index
        assert not client.exists(cache.tenant_index(a)) and client.zcard(cache.tenant_index(b)) == 1
        assert cache.get([1, 2, 3], params(b)) == answer(f"{b}'s answer")
    finally:
        cache.close()
        client.close()
