"""L2 host pool: LRU-K + LFU eviction, pinning, and L1 -> L2 -> L1 round trips with identical output."""

from __future__ import annotations

import pytest
import torch

from engine.l2_pool import HostBlockPool
from tests.test_prefix_cache import PREFIX, make_engine, model, run  # noqa: F401


def block(value: float) -> torch.Tensor:
    return torch.full((2, 3), value)


def test_blocks_used_once_go_before_blocks_that_keep_coming_back():
    pool = HostBlockPool(3, (2, 3), torch.float32, pin=False, k=2)
    pool.put(b"hot", block(1))
    pool.get(b"hot")  # two uses
    pool.put(b"once-old", block(2))
    pool.put(b"once-new", block(3))
    assert pool.victim() == b"once-old", "fewer than K uses: evicted first, older first"
    pool.put(b"incoming", block(4))
    assert b"once-old" not in pool and b"hot" in pool and pool.evictions == 1


def test_take_run_returns_the_slots_of_the_leading_keys_held_and_counts_each_as_a_use():
    pool = HostBlockPool(4, (2, 3), torch.float32, pin=False, k=2)
    for value, key in enumerate((b"a", b"b", b"c")):
        pool.put(key, block(value))
    slots = pool.take_run([b"a", b"b", b"missing", b"c"])
    assert [float(pool.pool[slot][0, 0]) for slot in slots] == [0.0, 1.0], "stops at the first miss"
    assert pool.hits == 2 and pool.take_run([b"missing"]) == []
    assert pool.victim() == b"c", "a and b now have K uses; c, used once, goes first"


def test_among_blocks_with_k_uses_the_oldest_kth_use_goes_and_pins_stay():
    pool = HostBlockPool(3, (2, 3), torch.float32, pin=False, k=2)
    for key in (b"a", b"b", b"c"):
        pool.put(key, block(0))
    pool.get(b"a")
    pool.get(b"b")
    pool.get(b"c")
    pool.get(b"a")
    assert pool.victim() == b"b"
    pool.put(b"b", block(9), pin=True)
    assert pool.victim() == b"c"
    assert torch.equal(pool.get(b"b"), block(9))


@pytest.mark.parametrize("l2_blocks", [16, 3], ids=["room-in-l2", "l2-full"])
def test_evicted_l1_blocks_come_back_from_l2_with_identical_output(model, l2_blocks):  # noqa: F811
    """With a full L2 (3 blocks), promoting the three blocks evicts the other three from L1 and L2 could
    only make room in the slots being read: the promotion's own blocks are never L2 victims."""
    plain = make_engine(model)
    plain.prefix_cache = None
    expected = run(plain, PREFIX + [5, 6])
    engine = make_engine(model, capacity=3)
    cache = engine.prefix_cache
    cache.l2 = HostBlockPool(l2_blocks, tuple(cache.pool.shape[1:]), cache.pool.dtype, pin=False)
    run(engine, PREFIX + [9])  # three blocks fill L1
    run(engine, [1] + list(range(150, 198)))  # three other blocks push them down to L2
    assert cache.evictions == 3 and len(cache.l2.index) == 3
    assert run(engine, PREFIX + [5, 6]) == expected
    assert cache.l2.hits == 3 and engine.stats.prefix_reused_tokens == 48


def test_promoting_a_long_chain_never_evicts_its_own_head(model):  # noqa: F811
    engine = make_engine(model, capacity=4)
    cache = engine.prefix_cache
    cache.l2 = HostBlockPool(16, tuple(cache.pool.shape[1:]), cache.pool.dtype, pin=False)
    long_prompt = [1] + list(range(200, 264))  # four blocks: exactly the L1 capacity
    expected = run(engine, long_prompt + [2])
    run(engine, [1] + list(range(100, 148)))  # pushes three of them down to L2, keeps the head in L1
    assert run(engine, long_prompt + [2]) == expected  # head from L1, the rest promoted from L2
    assert engine.stats.prefix_reused_tokens == 64


def test_a_run_of_blocks_is_kept_block_by_block():
    pool = HostBlockPool(2, (2, 3), torch.float32, pin=False)
    assert pool.put_many([b"x", b"y"], torch.stack([block(5), block(6)])) == 2
    assert torch.equal(pool.get(b"x"), block(5)) and torch.equal(pool.get(b"y"), block(6))


@pytest.mark.parametrize(
    "keep", [frozenset(), frozenset({b"old"})], ids=["run-longer-than-the-pool", "a-kept-slot"]
)
def test_a_run_scattered_at_once_leaves_the_pool_as_block_by_block_puts_would(keep):
    """put_many writes a host run with one scatter; slots reused inside the run must end with the
    later block, exactly as a put per block leaves them."""
    keys = [b"k%d" % i for i in range(5)]
    run = torch.stack([block(i) for i in range(5)])
    batched, sequential = (HostBlockPool(3, (2, 3), torch.float32, pin=False) for _ in range(2))
    for pool in (batched, sequential):
        pool.put(b"old", block(-1))
    stored = batched.put_many(keys, run, keep=keep)
    assert stored == sum(sequential.put(key, row, keep=keep) for key, row in zip(keys, run))
    assert set(batched.index) == set(sequential.index)
    for key in sequential.index:
        assert torch.equal(batched.get(key), sequential.get(key)), key


def test_a_demoted_chain_lands_in_slots_that_ascend_with_its_rows():
    """At 0% hits each demotion evicts an earlier chain, whose slots are freed tail first: handed out in
    that order they descended against the new chain's rows, and a 15-block demotion from CUDA was 15
    copies. The new chain must take them in row order: one run, one copy out and one copy back."""
    pool = HostBlockPool(8, (2, 3), torch.float32, pin=False)
    source = torch.stack([block(row) for row in range(12)])
    for chain in range(3):
        keys = [b"c%d-%d" % (chain, i) for i in range(4)]
        rows = list(range(4 * chain, 4 * chain + 4))
        assert pool.put_many(keys, source, rows=rows, oldest_first=keys[::-1]) == 4
        slots = [pool.index[key] for key in keys]
        assert slots == list(range(slots[0], slots[0] + 4)), slots
        assert [float(pool.pool[slot][0, 0]) for slot in slots] == rows
    assert pool.evictions == 4 and pool.take_run(keys) == slots


def test_the_lazy_heap_stays_bounded_under_repeated_hits():
    """Every use pushes a new rank and stale ones leave only from the heap's top: a block hit over and
    over without evictions grew the heap without bound (a slow leak in a long-running server)."""
    pool = HostBlockPool(4, (2, 3), torch.float32, pin=False)
    for key in (b"a", b"b", b"c"):
        pool.put(key, block(0))
    for _ in range(10_000):
        pool.get(b"a")
    assert len(pool._heap) <= 4 * len(pool.ranks) + 64
    pool.put(b"d", block(1))
    pool.put(b"e", block(2))
    assert b"a" in pool and b"b" not in pool, "eviction order is unchanged by the rebuild"


def test_victims_skip_kept_keys_without_losing_them():
    pool = HostBlockPool(3, (2, 3), torch.float32, pin=False, k=2)
    for key in (b"a", b"b", b"c"):
        pool.put(key, block(0))
    assert pool.victim(keep=frozenset({b"a"})) == b"b"
    assert pool.victim(keep=frozenset({b"a", b"b", b"c"})) is None
    assert pool.victim() == b"a", "a kept key stays a candidate afterwards"
    assert not pool.put(b"d", block(1), keep=frozenset({b"a", b"b", b"c"}))
    assert b"d" not in pool and all(key in pool for key in (b"a", b"b", b"c"))


@pytest.mark.parametrize("k", [1, 2, 3])
def test_the_victim_is_always_the_lowest_rank_under_random_traffic(k):
    """Blocks with fewer than K uses live in per-use-count tables, the rest on the heap: whatever the
    traffic, the victim is the unpinned, unkept key of lowest (K-th last use, uses, last use)."""
    import random

    rng = random.Random(k)
    pool = HostBlockPool(8, (2, 3), torch.float32, pin=False, k=k)
    keys = [b"k%d" % i for i in range(14)]
    for _ in range(600):
        key = rng.choice(keys)
        if key in pool and rng.random() < 0.5:
            pool.get(key)
        else:
            pool.put(key, block(0), pin=rng.random() < 0.03)
        keep = frozenset(rng.sample(sorted(pool.index), min(2, len(pool.index))))
        candidates = [key for key in pool.index if key not in pool.pinned and key not in keep]
        expected = min(candidates, key=lambda key: pool.rank(key), default=None)
        assert pool.victim(keep) == expected


class ReferencePool:
    """The eviction documented in engine/l2_pool.py, by brute force: every key's use ticks, and the
    victim is the unpinned, unkept key of lowest (K-th last use or -1, uses, last use)."""

    def __init__(self, capacity: int, k: int):
        self.k = k
        self.slots: dict[bytes, int] = {}
        self.ticks: dict[bytes, list[int]] = {}
        self.pinned: set[bytes] = set()
        self.free = list(range(capacity - 1, -1, -1))
        self.tick = self.evictions = self.hits = 0

    def rank(self, key: bytes) -> tuple[int, int, int]:
        ticks = self.ticks[key]
        return (ticks[-self.k] if len(ticks) >= self.k else -1, len(ticks), ticks[-1])

    def victim(self, keep: frozenset[bytes]) -> bytes | None:
        candidates = [key for key in self.slots if key not in self.pinned and key not in keep]
        return min(candidates, key=self.rank, default=None)

    def use(self, key: bytes) -> None:
        self.ticks[key].append(self.tick)
        self.tick += 1

    def put(self, key: bytes, pin: bool, keep: frozenset[bytes]) -> bool:
        if key not in self.slots:
            if self.free:
                slot = self.free.pop()
            elif (victim := self.victim(keep)) is None:
                return False
            else:
                slot = self.slots.pop(victim)
                del self.ticks[victim]
                self.evictions += 1
            self.slots[key], self.ticks[key] = slot, []
        if pin:
            self.pinned.add(key)
        self.use(key)
        return True

    def take_run(self, keys: list[bytes]) -> list[int]:
        slots = []
        for key in keys:
            if key not in self.slots:
                break
            slots.append(self.slots[key])
        for key in reversed(keys[: len(slots)]):  # the head used last
            self.use(key)
        self.hits += len(slots)
        return slots


@pytest.mark.parametrize("k", [1, 2, 3])
def test_put_many_evicts_as_the_reference_model_under_random_traffic(k):
    """put_many's path for new unpinned keys (the oldest once-used block out, the key in with no history)
    and the per-key path it skips must leave the pool exactly as the documented eviction: the same keys
    held in the same slots (the new keys of one run may trade theirs, to copy in runs), evictions, hits,
    ranks, victims and block contents, whatever the mix of new, held, repeated, pinned and kept keys in
    a run. A fresh pool every 150 steps: pins are never undone."""
    import random

    rng = random.Random(k)
    keys = [b"k%d" % i for i in range(24)]
    evictions = hits = 0
    for step in range(1500):
        if step % 150 == 0:
            pool, reference = HostBlockPool(6, (2, 3), torch.float32, pin=False, k=k), ReferencePool(6, k)
            contents: dict[bytes, float] = {}
        held = sorted(reference.slots)
        keep = frozenset(rng.sample(held, min(rng.choice([0, 0, 1, 3]), len(held))))
        if rng.random() < 0.3:
            run = rng.sample(held, rng.randint(0, len(held))) + [rng.choice(keys)]
            slots, expected = pool.take_run(run), reference.take_run(run)
            assert len(slots) == len(expected) and slots == [pool.index[key] for key in run[: len(slots)]]
        else:
            run = [rng.choice(keys) for _ in range(rng.randint(1, 9))]
            pin = rng.random() < 0.02
            rows = rng.sample(range(16), len(run))
            source = torch.stack([block(step * 100 + row) for row in range(16)])
            stored = [reference.put(key, pin, keep) for key in run]
            assert pool.put_many(run, source, keep, pin, rows=rows) == sum(stored)
            contents.update((key, step * 100 + row) for key, row, kept in zip(run, rows, stored) if kept)
        assert set(pool.index) == set(reference.slots) and pool.pinned == reference.pinned
        assert sorted(pool.index.values()) == sorted(reference.slots.values())  # new keys may trade slots
        assert (pool.evictions, pool.hits) == (reference.evictions, reference.hits)
        assert all(pool.rank(key) == reference.rank(key) for key in reference.slots)
        assert pool.victim(keep) == reference.victim(keep)
        assert all(float(pool.pool[slot][0, 0]) == contents[key] for key, slot in pool.index.items())
        if step % 150 == 149:
            evictions, hits = evictions + pool.evictions, hits + pool.hits
    assert evictions > 2000 and hits > 1000, (evictions, hits)
