"""The planners (kv_pools, warmup_planner, cache_sizing) against brute-force statements of their rules on
random inputs; two roundings found wrong in review (2026-12-07) at very large recorded counts."""

from __future__ import annotations

import math
import random
from fractions import Fraction


from engine.cache_sizing import CacheRequest, plan_tiers
from scheduler.kv_pools import plan_kv_pools
from scheduler.warmup_planner import percentile_length, plan_buckets


def ref_percentile(hist, p):
    total = sum(hist.values())
    rank = max(1, math.ceil(Fraction(p) / 100 * total))
    seen = 0
    for length in sorted(hist):
        seen += hist[length]
        if seen >= rank:
            return length


def test_percentile_random_small():
    rng = random.Random(1)
    for _ in range(3000):
        hist = {rng.randint(1, 300): rng.randint(1, 50) for _ in range(rng.randint(1, 8))}
        p = rng.choice([0.0, 1.0, 50.0, 90.0, 95.0, 99.0, 99.9, 100.0, rng.uniform(0, 100)])
        assert percentile_length(hist, p) == ref_percentile(hist, p)


def test_percentile_nearest_rank_large_counts():
    # 95% of 1000000000000018 is 950000000000017.1: rank 950000000000018. Length 100 holds one fewer.
    total = 1000000000000018
    hist = {100: 950000000000017, 200: total - 950000000000017}
    assert ref_percentile(hist, 95.0) == 200
    assert percentile_length(hist, 95.0) == 200


def ref_kv(reserved, slots, max_len, buckets, percentiles=(50.0, 90.0, 99.0)):
    clean = {}
    for k, v in reserved.items():
        if k > 0 and v > 0:
            clean[min(k, max_len)] = clean.get(min(k, max_len), 0) + v
    samples = sum(clean.values())
    classes = sorted({b for b in buckets if 0 < b < max_len} | {max_len})
    caps = sorted(
        {next(c for c in classes if c >= ref_percentile(clean, p)) for p in percentiles} | {max_len}
    )
    return clean, samples, caps


def check_kv_plan(plan, reserved, slots, max_len, buckets):
    clean, samples, caps = ref_kv(reserved, slots, max_len, buckets)
    assert plan.slots == slots
    capacities = [p.capacity for p in plan.pools]
    assert capacities == sorted(set(capacities))
    assert capacities[-1] == max_len and plan.pools[-1].slots >= 1
    assert all(p.slots > 0 for p in plan.pools)
    assert set(capacities) <= set(caps)
    for boundary in caps[:-1]:
        tail = sum(c for length, c in clean.items() if length > boundary)
        need = max(1, -(-slots * tail // samples))  # exact ceil of the tail's share
        able = sum(p.slots for p in plan.pools if p.capacity > boundary)
        assert able >= need, (boundary, able, need)


def test_kv_pools_random():
    rng = random.Random(2)
    for _ in range(1500):
        max_len = rng.choice([64, 100, 512, 2048, 4096])
        buckets = sorted(
            {rng.choice([16, 32, 48, 64, 128, 256, 304, 1024, 1376, 3000]) for _ in range(5)} | {max_len}
        )
        reserved = {rng.randint(1, max_len + 200): rng.randint(1, 1000) for _ in range(rng.randint(1, 10))}
        if sum(reserved.values()) < 50:
            continue
        slots = rng.randint(2, 64)
        plan = plan_kv_pools(reserved, slots, max_len, buckets)
        assert plan == plan_kv_pools(dict(reversed(list(reserved.items()))), slots, max_len, buckets)
        check_kv_plan(plan, reserved, slots, max_len, buckets)


def test_kv_pools_tail_share_rounded_up_with_large_counts():
    # A long-lived fleet histogram: 3e10 reserved lengths, p50 at 100 (class 256), a third plus one
    # of them at 1000. 3 slots' tail share above 256 is 1.0000000001 slots: rounded up, 2 slots must
    # hold more than 256 tokens.
    reserved = {100: 2 * 10**10 - 1, 1000: 10**10 + 1}
    slots, max_len, buckets = 3, 4096, (256, 1024, 4096)
    plan = plan_kv_pools(reserved, slots, max_len, buckets)
    check_kv_plan(plan, reserved, slots, max_len, buckets)


def test_buckets_random():
    rng = random.Random(3)
    for _ in range(1500):
        max_len = rng.choice([2, 10, 16, 17, 100, 512, 2047, 2048, 4096])
        hist = {rng.randint(1, max_len + 50): rng.randint(1, 100) for _ in range(rng.randint(0, 10))}
        plan = plan_buckets(
            hist, max_len, (16, 32, 64, 128, 256, 512, 1024, 2048, 8192), min_samples=rng.choice([0, 1, 50])
        )
        b = plan.buckets
        assert list(b) == sorted(set(b)) and b[-1] == max_len and all(0 < x <= max_len for x in b)
        if plan.source == "traffic":
            for lo, hi in zip(b, b[1:]):
                assert hi <= 2 * lo + 16, (b, lo, hi)
            for length in hist:
                if length <= max_len:
                    assert any(x >= length for x in b)


def test_tiers_random():
    rng = random.Random(4)
    for _ in range(3000):
        bb = rng.randint(1, 10**7)
        req = CacheRequest(
            rng.randint(0, 5000),
            rng.randint(0, 5000),
            rng.choice([0, rng.randint(bb, 10**11)]),
            rng.choice([0, rng.randint(bb, 10**11)]),
        )
        on_device = rng.random() < 0.5
        dev = rng.choice([None, rng.randint(0, 10**11)])
        host = rng.choice([None, rng.randint(0, 10**11)])
        try:
            s = plan_tiers(req, bb, on_device, dev, host)
        except ValueError:
            continue
        l1b = s.l1_blocks * bb
        if req.l1_memory:
            assert l1b <= req.l1_memory
        if req.l2_memory and s.l1_blocks:
            assert s.l2_blocks * bb <= req.l2_memory
        if host is not None:
            assert s.l2_blocks * bb + (0 if on_device else l1b) <= Fraction(4, 5) * host
        if dev is not None and on_device and s.l1_blocks:
            assert l1b <= dev - max(2**29, dev // 10)
