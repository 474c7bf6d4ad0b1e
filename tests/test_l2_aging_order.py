"""put_many with `oldest_first` (every L1 demotion) against the brute-force reference of the documented
LRU-K + LFU eviction, processing the run in its aging order: same keys held, same victims.
(review, 2026-12-07)"""

from __future__ import annotations

import random

import pytest
import torch

from engine.l2_pool import HostBlockPool
from tests.test_l2_pool import ReferencePool, block


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("capacity", [1, 2, 3, 6])
def test_aging_order_matches_reference(seed, k, capacity):
    rng = random.Random(seed * 100 + k)
    keys = [b"k%d" % i for i in range(12)]
    pool, reference = (
        HostBlockPool(capacity, (2, 3), torch.float32, pin=False, k=k),
        ReferencePool(capacity, k),
    )
    contents = {}
    for step in range(400):
        held = sorted(reference.slots)
        keep = frozenset(rng.sample(held, min(rng.choice([0, 0, 1, 2]), len(held))))
        if rng.random() < 0.3:
            run = rng.sample(held, rng.randint(0, len(held))) + [rng.choice(keys)]
            assert len(pool.take_run(run)) == len(reference.take_run(run))
        else:
            run = rng.sample(keys, rng.randint(1, 5))  # distinct, as L1's evicted keys
            aging = rng.sample(run, len(run))
            rows = rng.sample(range(16), len(run))
            source = torch.stack([block(step * 100 + row) for row in range(16)])
            row_of = dict(zip(run, rows))
            stored = {key: reference.put(key, False, keep) for key in aging}
            # later keys of the run may evict earlier ones of the same run
            assert pool.put_many(run, source, keep, rows=rows, oldest_first=aging) == sum(stored.values())
            contents.update((key, step * 100 + row_of[key]) for key in run if key in reference.slots)
        assert set(pool.index) == set(reference.slots), step
        assert pool.victim(keep) == reference.victim(keep), step
        assert all(float(pool.pool[slot][0, 0]) == contents[key] for key, slot in pool.index.items())
