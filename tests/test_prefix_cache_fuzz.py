"""Randomized L1/L2 state-machine fuzz: tiny pools, pins, adopt, lookups without stores, fault injection."""

from __future__ import annotations

import random

import pytest
import torch

import engine.l2_pool as l2_mod
import engine.prefix_cache as pc_mod
from engine.l2_pool import HostBlockPool
from engine.prefix_cache import PrefixCache
from tests.test_prefix_cache_random import BLOCK, MemoryL3, SlotRunner, truth


PARENT: dict = {}
STRICT_L2_PINS = True


class Boom(RuntimeError):
    pass


class Faults:
    def __init__(self, rng, rate):
        self.rng, self.rate, self.armed = rng, rate, False

    def maybe(self):
        if self.armed and self.rng.random() < self.rate:
            raise Boom("injected")


def check_l2(l2: HostBlockPool, where: str) -> None:
    assert sorted([*l2.free, *l2.index.values()]) == list(range(len(l2.pool))), f"{where}: L2 slots"
    assert l2.pinned <= set(l2.index), f"{where}: L2 pinned not held"
    young_keys = [key for young in l2._young for key in young]
    assert len(young_keys) == len(set(young_keys)), f"{where}: key in two young tables"
    assert not (set(young_keys) & set(l2.history)), f"{where}: young and history"
    assert set(young_keys) | set(l2.history) == set(l2.index), f"{where}: state vs index"
    assert set(l2.ranks) == set(l2.history), f"{where}: ranks vs history"
    assert not (set(young_keys) & l2.pinned), f"{where}: pinned in young"
    for key, slot in l2.index.items():
        assert float(l2.pool[slot].flatten()[0]) == truth(key), f"{where}: L2 slot {slot} holds another"


def check(cache: PrefixCache, where: str) -> None:
    assert sorted([*cache.free, *cache.index.values()]) == list(range(cache.capacity)), f"{where}: L1 rows"
    assert cache.pinned <= set(cache.index), f"{where}: a pinned key is not held"
    assert len(cache.pinned) <= cache.capacity // 2, f"{where}: too many pinned"
    assert not cache._protected, f"{where}: protected left over"
    for key, row in cache.index.items():
        assert float(cache.pool[row].flatten()[0]) == truth(key), f"{where}: L1 row {row} holds another block"
    if cache.l2 is not None:
        check_l2(cache.l2, where)
        assert len(cache.l2.pinned) <= len(cache.l2.pool) // 2, f"{where}: L2 pinned beyond half"
    if cache.l2 is not None and STRICT_L2_PINS:
        for key in cache.l2.pinned:
            parent = PARENT.get(key)
            assert parent is None or parent in cache.pinned or parent in cache.l2.pinned, (
                f"{where}: L2 pinned block behind an unpinned parent"
            )
    for key in cache.pinned:
        parent = PARENT.get(key)
        assert parent is None or parent in cache.pinned, f"{where}: pinned L1 block behind an unpinned head"


def run_fuzz(seed, l1_cap, l2_cap, k, faults_rate, use_l3, steps=400):
    rng = random.Random(seed)
    runner = SlotRunner()
    cache = PrefixCache(runner, l1_cap, BLOCK, "fp")
    if l2_cap:
        cache.l2 = HostBlockPool(l2_cap, tuple(cache.pool.shape[1:]), cache.pool.dtype, pin=False, k=k)
    l3 = None
    if use_l3:
        l3 = MemoryL3()
        cache.l3, cache.publish_on_first_use = l3, True
    faults = Faults(rng, faults_rate)
    real_l2_copy, real_pc_copy = l2_mod.copy_rows, pc_mod.copy_rows

    def l2_copy(*a, **kw):
        faults.maybe()
        return real_l2_copy(*a, **kw)

    def pc_copy(*a, **kw):
        faults.maybe()
        return real_pc_copy(*a, **kw)

    l2_mod.copy_rows, pc_mod.copy_rows = l2_copy, pc_copy
    try:
        families = [[rng.randint(1, 3) for _ in range(16)] for _ in range(3)]
        for step in range(steps):
            where = f"seed {seed} step {step}"
            tenant = rng.choice(["a", "b"])
            prompt = rng.choice(families)[: rng.randint(2, 13)]
            if rng.random() < 0.3:
                prompt = prompt + [rng.randint(1, 50) for _ in range(rng.randint(0, 5))]
            keys = cache.chain_keys(prompt, tenant)
            for parent, child in zip([None, *keys], keys):
                PARENT[child] = parent
            op = rng.random()
            faults.armed = faults_rate > 0
            try:
                if op < 0.1 and keys:
                    # adopt: blocks of a leading run (as the L3 prefetch)
                    n = rng.randint(0, len(keys))
                    blocks = [torch.full(tuple(cache.pool.shape[1:]), truth(key)) for key in keys[:n]]
                    cache.adopt(keys, blocks)
                    continue
                hint = cache.hint(prompt, tenant) if rng.random() < 0.5 else None
                hits = cache.lookup(prompt, tenant, hint)
                faults.armed = False
                served = [float(cache.pool[row].flatten()[0]) for row in hits]
                assert served == [truth(key) for key in keys[: len(hits)]], f"{where}: lookup served wrong KV"
                assert len(set(hits)) == len(hits), f"{where}: duplicate rows"
                if hits:
                    cache.load(0, hits)
                runner.compute(0, keys, len(hits))
                if op < 0.2:
                    continue  # a lookup without store (resumed request)
                faults.armed = faults_rate > 0
                pin = rng.random() < 0.15
                head = keys[: rng.randint(0, len(keys))] if rng.random() < 0.3 else None
                cache.store(0, prompt[: len(keys) * BLOCK], tenant, pin=pin, head=head)
            except Boom:
                pass
            finally:
                faults.armed = False
            check(cache, where)
    finally:
        l2_mod.copy_rows, pc_mod.copy_rows = real_l2_copy, real_pc_copy
    return cache


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("l1_cap,l2_cap", [(1, 0), (2, 1), (3, 2), (2, 3), (3, 3), (1, 2)])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_fuzz_no_faults(seed, l1_cap, l2_cap, k):
    run_fuzz(seed, l1_cap, l2_cap, k, 0.0, use_l3=seed % 2 == 0)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("l1_cap,l2_cap", [(2, 1), (3, 2), (2, 3), (3, 3)])
@pytest.mark.parametrize("k", [1, 2])
def test_fuzz_faults(seed, l1_cap, l2_cap, k):
    run_fuzz(seed, l1_cap, l2_cap, k, 0.2, use_l3=seed % 2 == 0)
