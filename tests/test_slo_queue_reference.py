"""SloQueue against a brute-force reference of its documented policy (no heaps, no lazy deletion), on random
operation sequences (review, 2026-12-07)."""

from __future__ import annotations

import random

import pytest

from scheduler.slo_queue import SloQueue
from scheduler.tiers import TierTable


class Ref:
    def __init__(self, floor, aging_ns, fair=True):
        self.floor = floor
        self.aging_ns = aging_ns
        self.fair = fair
        self.live = {}  # key -> dict
        self.counters = {}
        self.mark = {}
        self.tier_w = {}
        self.ten_w = {}
        self.seq = 0

    def lane(self, t):
        return t if self.fair else "default"

    def push(self, key, priority, deadline, tenant, cost, now, expires=None):
        lane = self.lane(tenant)
        active_lanes = {self.lane(e["tenant"]) for e in self.live.values() if e["priority"] == priority}
        if lane not in active_lanes:
            mark = self.mark.get(priority, 0.0)
            act = [self.counters.get((priority, t), mark) for t in active_lanes]
            lift = min(act) if act else mark
            k = (priority, lane)
            self.counters[k] = max(self.counters.get(k, lift), lift)
        self.live[key] = dict(
            key=key,
            priority=priority,
            deadline=deadline,
            seq=self.seq,
            tenant=tenant,
            cost=cost,
            enq=now,
            expires=expires,
        )
        self.seq += 1

    def level(self, p, waited):
        if p <= self.floor or self.aging_ns == 0:
            return p
        aging = max(1, round(self.aging_ns / self.tier_w.get(p, 1.0)))
        return max(self.floor, p - max(0, waited) // aging)

    def select(self, now):
        byp = {}
        for e in self.live.values():
            byp.setdefault(e["priority"], []).append(e)
        cands = []
        for p, es in byp.items():
            old = min(es, key=lambda e: (e["enq"], e["seq"]))
            cands.append((self.level(p, now - old["enq"]), old["enq"], old["seq"], p))
        lvl, _, _, p = min(cands)
        native = min(c[3] for c in cands)
        contested = sum(1 for c in cands if c[0] == lvl) > 1
        es = byp[p]
        if p != native or contested:
            return min(es, key=lambda e: (e["enq"], e["seq"]))
        lanes = {}
        for e in es:
            lanes.setdefault(self.lane(e["tenant"]), []).append(e)
        best = None
        for ln, les in lanes.items():
            h = min(les, key=lambda e: (e["deadline"], e["seq"]))
            k = (self.counters[(p, ln)], h["deadline"], h["seq"], ln)
            if best is None or k < best[0]:
                best = (k, h)
        return best[1]

    def pop(self, now):
        e = self.select(now)
        p, ln = e["priority"], self.lane(e["tenant"])
        c = self.counters.get((p, ln), self.mark.get(p, 0.0))
        self.mark[p] = c
        self.counters[(p, ln)] = c + e["cost"] / self.ten_w.get(e["tenant"], 1.0)
        del self.live[e["key"]]
        return e["key"]

    def remove(self, key):
        return self.live.pop(key, None) is not None

    def expire(self, now):
        out = [k for k, e in self.live.items() if e["expires"] is not None and e["expires"] <= now]
        for k in out:
            del self.live[k]
        return sorted(out)


TIERS = TierTable.defaults()
MS = 1_000_000


class Clock:
    now = 0

    def __call__(self):
        return self.now


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("fair", [True, False])
def test_matches_reference(seed, fair):
    rng = random.Random(seed)
    clock = Clock()
    aging = rng.choice([0, 1, 5 * MS, 50 * MS])
    q = SloQueue(TIERS, aging_ns=aging, fair_share=fair, clock=clock)
    ref = Ref(q.aging_floor, q.aging_ns, fair)
    ntenants = rng.choice([1, 2, 5, 40])
    popp = rng.choice([0.6, 0.8, 0.9])
    for step in range(3000):
        clock.now += rng.choice([0, 0, 1, MS, 7 * MS])
        op = rng.random()
        if op < 0.45:
            p = rng.randint(1, 4)
            dl = rng.choice([0, clock.now, clock.now + rng.randint(0, 5) * MS, 2**62])
            t = f"t{rng.randint(0, ntenants - 1)}"
            cost = rng.choice([1.0, 3.0, rng.uniform(0.5, 100)])
            exp = clock.now + rng.randint(0, 50) * MS if rng.random() < 0.3 else None
            q.push(step, p, dl, key=step, tenant=t, cost=cost, expires_ns=exp)
            ref.push(step, p, dl, t, cost, clock.now, exp)
        elif op < popp:
            if q:
                want = ref.pop(clock.now)
                got = q.pop_entry().key
                assert got == want, (step, got, want)
        elif op < 0.9:
            k = rng.randint(0, step)
            assert (q.remove(k) is not None) == ref.remove(k)
        elif op < 0.95:
            got = sorted(e.key for e in q.pop_expired(clock.now))
            assert got == ref.expire(clock.now)
        elif op < 0.975:
            p = rng.randint(1, 4)
            w = rng.choice([0.1, 0.5, 1.0, 2.0, 10.0])
            q.set_tier_weight(p, w)
            ref.tier_w[p] = w
        else:
            t = f"t{rng.randint(0, ntenants - 1)}"
            w = rng.choice([0.25, 1.0, 4.0])
            q.set_tenant_weight(t, w)
            ref.ten_w[t] = w
        assert len(q) == len(ref.live)
