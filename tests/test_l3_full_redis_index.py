"""A full Redis (noeviction, as README's "bounded Redis" section allows) can take a block's SET and then
refuse the tenant index's ZADD in the same pipeline: the block was stored and reported stored, but no
index listed it, so forget-tenant could not find it; now the write fails and the values go (found in
review, 2026-12-07)."""

from __future__ import annotations

import uuid

import pytest
import redis
import torch

from cache.kv_format import KVBlockMeta
from cache.redis_kv_store import RedisKVStore
from cache.tenant_erasure import erase_tenant
from deploy.launch import find_free_port
from tests.test_redis_auth import spawn_redis

SHAPE = (1, 2, 1, 16, 128)
META = KVBlockMeta("fp", "float32", SHAPE, 16, "L2HBD-v1")


@pytest.fixture(scope="module")
def noeviction_url(tmp_path_factory):
    port = find_free_port()
    url = f"redis://127.0.0.1:{port}/0"
    proc = spawn_redis(
        tmp_path_factory.mktemp("full"), ["--port", str(port), "--maxmemory-policy", "noeviction"], url
    )
    yield url
    proc.terminate()
    proc.wait(timeout=10)


def test_a_block_stored_into_a_full_redis_is_always_erasable(noeviction_url):
    raw = redis.Redis.from_url(noeviction_url)
    nbytes = torch.Size(SHAPE).numel() * 4
    unlisted = []
    try:
        for step in range(0, 600):  # maxmemory from just above the used memory to 6 blocks above it
            raw.config_set("maxmemory", 0)
            raw.flushall()
            store = RedisKVStore(noeviction_url, f"rv:{uuid.uuid4().hex[:8]}", timeout_s=1.0)
            try:
                used = raw.info("memory")["used_memory"]
                raw.config_set("maxmemory", int(used + step * nbytes / 100))
                key = uuid.uuid4().bytes
                stored = store.put_chain([key], [torch.ones(SHAPE)], META, tenant="acme")
                raw.config_set("maxmemory", 0)
                name = store.redis_key(key)
                if stored and raw.zscore(store.tenant_index("acme"), name) is None:
                    erase_tenant(raw, "acme")
                    unlisted.append((step, bool(raw.exists(name)), store.stats.errors))
            finally:
                store.close()
        assert not unlisted, (
            f"stored, counted as stored, not indexed: (step, survives forget-tenant, errors) {unlisted}"
        )
    finally:
        raw.config_set("maxmemory", 0)
        raw.close()
