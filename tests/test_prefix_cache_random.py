"""Random traffic against the real prefix cache (L1, with L2 and an in-memory L3 behind it), checked after
every request against what must always hold: every L1 row and L2 slot is free or holds one key, once; a
pinned key is held; every held block is that key's KV; a reused block is the prompt's own. Found the
store that evicted its own chain's head (rows leaked for good once its orphans were re-entered)."""

from __future__ import annotations

import hashlib
import random
from concurrent.futures import Future

import pytest
import torch

from cache.cost_model import LoadCostModel
from engine.l2_pool import HostBlockPool
from engine.model_runner import KVShape
from engine.prefix_cache import PrefixCache

BLOCK = 2  # tokens per block: short prompts make long chains


def truth(key: bytes) -> float:
    """The KV a block of `key` must hold (a float exact in float32)."""
    return float(int.from_bytes(hashlib.sha256(key).digest()[:3], "little"))


class SlotRunner:
    """A slot's KV as one value per block, written as `truth` of the block's key when computed."""

    def __init__(self, slots: int = 1, max_blocks: int = 32):
        self.shape = KVShape(layers=1, slots=slots, kv_heads=1, max_len=max_blocks * BLOCK, head_dim=1)
        self.dtype, self.device = torch.float32, torch.device("cpu")
        self.kv = torch.full((slots, max_blocks), -1.0)

    def read_blocks(self, slot: int, count: int, block_size: int) -> torch.Tensor:
        values = self.kv[slot, :count].clone().view(count, 1, 1, 1, 1, 1)
        return values.expand(count, 1, 2, 1, block_size, 1).contiguous()

    def write_blocks(self, slot: int, blocks: torch.Tensor) -> None:
        self.kv[slot, : blocks.shape[0]] = blocks[:, 0, 0, 0, 0, 0]

    def compute(self, slot: int, keys: list[bytes], start: int) -> None:
        for i in range(start, len(keys)):
            self.kv[slot, i] = truth(keys[i])


class MemoryL3:
    """L3's interface over a dict, with the publish-on-first-use policy: every stored block reaches it."""

    def __init__(self):
        self.blocks: dict[bytes, torch.Tensor] = {}
        self.cost = LoadCostModel()

    def probe(self, keys: list[bytes]) -> Future:
        answered: Future = Future()
        answered.set_result([key in self.blocks for key in keys])
        return answered

    def wait_probe(self, probe: Future) -> list[bool]:
        return probe.result()

    def fetch(self, keys: list[bytes], present=None) -> list[torch.Tensor]:
        found = []
        for key in keys:
            if key not in self.blocks:
                break
            found.append(self.blocks[key].clone())
        return found

    renews = False  # no tenant quota

    def unknown(self, keys: list[bytes]) -> list[int]:
        return [i for i, key in enumerate(keys) if key not in self.blocks]

    def publish(self, keys: list[bytes], blocks: torch.Tensor, tenant=None, head=None) -> None:
        for key, block in zip(keys, blocks):
            self.blocks[key] = block.clone()


def check(cache: PrefixCache, where: str) -> None:
    assert sorted([*cache.free, *cache.index.values()]) == list(range(cache.capacity)), f"{where}: L1 rows"
    assert cache.pinned <= set(cache.index), f"{where}: a pinned key is not held"
    for key, row in cache.index.items():
        assert float(cache.pool[row].flatten()[0]) == truth(key), f"{where}: L1 row {row} holds another block"
    if cache.l2 is not None:
        l2 = cache.l2
        assert sorted([*l2.free, *l2.index.values()]) == list(range(len(l2.pool))), f"{where}: L2 slots"
        for key, slot in l2.index.items():
            assert float(l2.pool[slot].flatten()[0]) == truth(key), f"{where}: L2 slot {slot} holds another"


def serve(cache: PrefixCache, runner: SlotRunner, prompt: list[int], tenant: str, pin: bool = False) -> list:
    """What the engine's prefill and its later store do for one request on slot 0; returns its hits."""
    keys = cache.chain_keys(prompt, tenant)
    hits = cache.lookup(prompt, tenant)
    if hits:
        cache.load(0, hits)
    assert [float(v) for v in runner.kv[0, : len(hits)]] == [truth(k) for k in keys[: len(hits)]]
    runner.compute(0, keys, len(hits))
    cache.store(0, prompt[: len(keys) * BLOCK], tenant, pin=pin)
    return hits


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("tiers", ["l1", "l1+l2", "l1+l2+l3", "l1+l3"])
def test_random_traffic_keeps_every_row_and_block_right(seed, tiers):
    rng = random.Random(seed)
    runner = SlotRunner()
    cache = PrefixCache(runner, rng.randint(3, 8), BLOCK, "fp")
    if "l2" in tiers:
        cache.l2 = HostBlockPool(rng.randint(2, 8), tuple(cache.pool.shape[1:]), cache.pool.dtype, pin=False)
    if "l3" in tiers:
        cache.l3, cache.publish_on_first_use = MemoryL3(), True
    families = [[rng.randint(1, 3) for _ in range(24)] for _ in range(4)]  # prompts sharing prefixes
    for step in range(300):
        prompt = rng.choice(families)[: rng.randint(2, 21)]
        if rng.random() < 0.3:
            prompt = prompt + [rng.randint(1, 50) for _ in range(rng.randint(0, 6))]
        serve(cache, runner, prompt, rng.choice(["a", "b"]), pin=rng.random() < 0.05)
        check(cache, f"step {step}")
