"""L3Tier.publish: a block skipped as already in Redis *between* fresh ones heads the later run's write, so a
quota trims that tail before it (it was left out of the head: found in review, 2026-12-07)."""

from __future__ import annotations

import uuid

import torch

from cache.kv_format import KVBlockMeta
from cache.redis_kv_store import RedisKVStore
from engine.kv_tiers import LAYOUT, L3Tier

META = KVBlockMeta("fp", "float32", (1, 2, 1, 4, 2), 4, LAYOUT)


class Clock:
    now = 0.0

    def __call__(self):
        return self.now


def test_skipped_middle_block_is_kept_as_head_of_the_new_tail(redis_server):
    store = RedisKVStore(redis_server, f"rv:{uuid.uuid4().hex[:8]}", timeout_s=0.5, tenant_max_blocks=4)
    clock = Clock()
    l3 = L3Tier(store, META, ttl_s=100.0, clock=clock)
    a, b, c, d = (f"{uuid.uuid4().hex}{i}".encode() for i in range(4))
    blocks = torch.ones(4, 1, 2, 1, 4, 2)
    try:
        l3.publish([a], blocks[:1], "t")  # t=0: A written
        assert l3._writes.drain()
        clock.now = 10.0
        l3.publish([a, b], blocks[:2], "t")  # t=10: A known, B written (head [A])
        assert l3._writes.drain()
        clock.now = 55.0  # A's mark is past half the TTL, B's is not
        l3.publish([a, b, c, d], blocks, "t")  # writes A, C, D; B skipped as known
        assert l3._writes.drain()
        index = store.tenant_index("t")
        score = {k: store.client.zscore(index, store.redis_key(k)) for k in (a, b, c, d)}
        assert score[b] > score[c] > score[d], f"B is C's head but ranks below it: {score}"
    finally:
        l3.close()


def test_quota_trim_then_deletes_the_middle_block_and_keeps_the_unreachable_tail(redis_server):
    store = RedisKVStore(redis_server, f"rv:{uuid.uuid4().hex[:8]}", timeout_s=0.5, tenant_max_blocks=4)
    clock = Clock()
    l3 = L3Tier(store, META, ttl_s=100.0, clock=clock)
    a, b, c, d, e = (f"{uuid.uuid4().hex}{i}".encode() for i in range(5))
    blocks = torch.ones(4, 1, 2, 1, 4, 2)
    try:
        l3.publish([a], blocks[:1], "t")
        assert l3._writes.drain()
        clock.now = 10.0
        l3.publish([a, b], blocks[:2], "t")
        assert l3._writes.drain()
        clock.now = 55.0
        l3.publish([a, b, c, d], blocks, "t")
        assert l3._writes.drain()
        l3.publish([e], blocks[:1], "t")  # 5 > 4: the lowest-ranked block goes
        assert l3._writes.drain()
        present = [bool(store.client.exists(store.redis_key(k))) for k in (a, b, c, d)]
        # a trim must take tails first: never B while C and D (unreachable without B) stay
        assert present in ([True] * 4, [True, True, True, False]), present
    finally:
        l3.close()
