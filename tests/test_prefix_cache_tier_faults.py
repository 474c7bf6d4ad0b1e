"""L1 and L2 faults found in review (2026-12-07): a failed demotion copy, pinning a warmed template's head,
pin room spent twice, a demoted chain longer than L2's room."""

from __future__ import annotations

import torch

import engine.l2_pool as l2_pool_module
from engine.l2_pool import HostBlockPool
from engine.prefix_cache import PrefixCache
from tests.test_prefix_cache_random import BLOCK, SlotRunner, truth


def serve(cache: PrefixCache, runner: SlotRunner, prompt: list[int], tenant: str) -> list[int]:
    """The engine's prefill + later store for one request on slot 0; returns the lookup's rows."""
    keys = cache.chain_keys(prompt, tenant)
    hits = cache.lookup(prompt, tenant)
    if hits:
        cache.load(0, hits)
    runner.compute(0, keys, len(hits))
    cache.store(0, prompt[: len(keys) * BLOCK], tenant)
    return hits


def test_a_failed_l2_demotion_copy_leaves_no_key_pointing_at_another_blocks_kv(monkeypatch):
    """`put_many` indexes the demoted keys (evicting the L2 blocks they replace) before copying the data;
    when the copy raises (a host/device memory failure: counted as a tier error, 'the blocks are
    forgotten'), the keys must not stay indexed at slots that still hold the evicted blocks' KV, which a
    later lookup would promote, another tenant's, as the prompt's own."""
    runner = SlotRunner()
    cache = PrefixCache(runner, 2, BLOCK, "fp")
    cache.l2 = HostBlockPool(2, tuple(cache.pool.shape[1:]), cache.pool.dtype, pin=False)
    a = [1, 2, 3, 4, 5]  # two full blocks, tenant "acme"
    b = [1, 2, 3, 4, 5]  # the same tokens, tenant "globex": other keys, other KV
    serve(cache, runner, a, "acme")
    serve(cache, runner, b, "globex")  # acme's blocks go to L2
    real, calls = l2_pool_module.copy_rows, []

    def failing_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("host memory failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(l2_pool_module, "copy_rows", failing_once)
    serve(cache, runner, [9, 9, 9, 9, 9], "initech")  # globex's blocks demoted: the copy raises
    assert cache.tier_errors == 1
    keys = cache.chain_keys(b, "globex")
    hits = cache.lookup(b, "globex")
    served = [float(cache.pool[row].flatten()[0]) for row in hits]
    assert served == [truth(key) for key in keys[: len(hits)]], "globex was served acme's KV from L2"


def test_an_adopted_templates_head_is_pinned_with_its_tail():
    """`adopt` pinned only the blocks it added; a template whose head L1 already held got its tail pinned
    and its head left evictable (the template store that follows in `prefill_template` then found no pin
    room for it). Once the head was evicted the pinned tail was unreachable: the template lost, its rows
    held for good. The pin room (half of 4) goes head first."""
    runner = SlotRunner()
    cache = PrefixCache(runner, 4, BLOCK, "fp")  # pin room: 2 blocks
    template = [1, 2, 3, 4, 5, 6, 7]  # three full blocks before its last token
    keys = cache.chain_keys(template, "t")
    serve(cache, runner, template[:3], "t")  # an earlier request left the template's head in L1
    assert keys[0] in cache.index
    fetched = [torch.full(tuple(cache.pool.shape[1:]), truth(key)) for key in keys]
    cache.adopt(keys, fetched)  # the warmup's L3 prefetch of the template
    # what prefill_template does next: prefill (lookup + compute) and a pinned store
    hits = cache.lookup(template, "t")
    cache.load(0, hits)
    runner.compute(0, keys, len(hits))
    cache.store(0, template[: len(keys) * BLOCK], "t", pin=True)
    for start in range(20, 60, 4):  # other traffic
        serve(cache, runner, [start, start + 1, start + 2], "t")
    pinned = [key in cache.pinned for key in keys]
    assert pinned == [True, True, False], f"pin room 2: the head's two blocks, got {pinned}"
    assert len(cache.lookup(template, "t")) == 2, f"held {[key in cache.index for key in keys]}"


def test_pin_room_is_not_spent_on_blocks_already_pinned():
    """`_warm` pinned `held[:room]`, `held` head first including blocks pinned before: a template that
    extends a pinned one spent its room on the pinned head again, and its own new block stayed unpinned
    though the pool had pin room left (half of 4 = 2, one used), to be evicted like any block."""
    runner = SlotRunner()
    cache = PrefixCache(runner, 4, BLOCK, "fp")
    short, long = [1, 2, 3], [1, 2, 3, 4, 5]  # one block, and the same block plus one
    for template in (short, long):  # as prefill_template: prefill, then a pinned store
        keys = cache.chain_keys(template, "t")
        hits = cache.lookup(template, "t")
        if hits:
            cache.load(0, hits)
        runner.compute(0, keys, len(hits))
        cache.store(0, template[: len(keys) * BLOCK], "t", pin=True)
    assert len(cache.pinned) == 2, f"{len(cache.pinned)} of 2 pinnable blocks pinned"
    for start in range(20, 60, 4):  # other traffic
        serve(cache, runner, [start, start + 1, start + 2], "t")
    assert len(cache.lookup(long, "t")) == 2, "the extending template's block was evicted"


def test_a_demoted_chain_longer_than_l2s_evictable_room_keeps_its_head_not_its_tail():
    """L2 holds two hot blocks (K = 2 uses each) and has two free slots. L1 demotes a 3-block chain:
    `put_many` entered its keys in row order, head first, and the tail's slot was taken from the oldest
    once-used block, the chain's own head entered a moment before: L2 kept the middle and the tail, which
    no lookup can reach (docs/INTERNALS.md: "L2 never drops a head and keeps a tail no lookup can
    reach"). Entered in eviction order (tail first), the tail is the one to go."""
    runner = SlotRunner()
    cache = PrefixCache(runner, 3, BLOCK, "fp")
    cache.l2 = HostBlockPool(4, tuple(cache.pool.shape[1:]), cache.pool.dtype, pin=False)
    hot = [b"hot-1", b"hot-2"]
    cache.l2.put_many(hot, torch.zeros(2, *cache.pool.shape[1:]))
    cache.l2.take_run(hot)  # K = 2 uses each: after once-used blocks in the eviction order
    p = [1, 2, 3, 4, 5, 6, 7]  # three full blocks before its last token
    serve(cache, runner, p, "t")
    serve(cache, runner, [9, 8, 7, 6, 5, 4, 3], "t")  # L1 full: p's three blocks go to L2
    keys = cache.chain_keys(p, "t")
    held = [key in cache.l2 for key in keys]
    assert held[0], f"L2 holds {held} of the chain (head first): a tail without its head"
