"""Preemption and resume (found in review, 2026-12-07): a suspended request, its first-token deadline long
gone, used to preempt a lower-tier running request as queue head though no first token was at stake; and
a randomized check that resumed requests give an uninterrupted run's tokens and leave nothing behind."""

from __future__ import annotations

import random
import time
from dataclasses import replace

import pytest

from engine.engine import Engine
from engine.model_runner import ModelRunner
from engine.prefix_cache import PrefixCache
from scheduler.preemption import PreemptionPolicy
from scheduler.tiers import TierTable
from tests.test_engine_batching import BUCKETS, EOS, RecordingSink, model, request, run_until_idle  # noqa: F401
from tests.test_preemption import URGENT_TIERS

# critical due at once; standard's TTFT target short so that a standard request that has already
# streamed tokens is past its first-token deadline (as any request running longer than its target is)
TIERS = TierTable(
    tuple(
        replace(t, ttft_target_ms=1.0) if t.name in ("critical", "standard") else t
        for t in TierTable.defaults().tiers
    )
)
FAR = time.time_ns() + 3600 * 10**9


def test_a_resumed_request_does_not_preempt_for_a_first_token_deadline_it_already_met(model):  # noqa: F811
    runner = ModelRunner(model, slots=2, max_len=128, kv_buckets=BUCKETS, pools=[(64, 1), (128, 1)])
    engine = Engine(
        runner, lambda t: bytes([97 + t % 26]), {EOS}, BUCKETS, preemption=PreemptionPolicy(), tiers=TIERS
    )
    batch, standard, critical = RecordingSink(), RecordingSink(), RecordingSink()
    engine.submit(
        request([1, 2, 3], batch, rid="batch", priority=4, tier="batch", deadline=FAR, max_tokens=40)
    )
    engine.step()  # batch takes the short (64) slot
    engine.submit(
        request([1, 4, 5], standard, rid="std", priority=3, tier="standard", deadline=0, max_tokens=40)
    )
    engine.step()  # standard takes the long slot (the short one is busy)
    assert {s.request.request_id: runner.slot_capacity(s.slot) for s in engine._active.values()} == {
        "batch": 64,
        "std": 128,
    }
    assert standard.windows and batch.windows
    urgent = [1, *range(50, 80)]  # 31 + 40 tokens: only the long slot holds it, so standard yields
    engine.submit(
        request(urgent, critical, rid="crit", priority=1, tier="critical", deadline=0, max_tokens=40)
    )
    engine.step()
    # critical took the long slot from standard (the only slot that holds it); in the same admission
    # loop the suspended standard request, now the queue's head, had its first token long ago: no TTFT to
    # protect, yet it used to take the batch request's slot
    assert engine.stats.preemptions == 1 and "batch" not in engine._suspended, (
        f"cascade: {engine.stats.preemptions} preemptions, suspended {sorted(engine._suspended)}"
    )


FAR = time.time_ns() + 3600 * 10**9


# URGENT_TIERS with queue times no slow machine reaches: this check is about resumes, not expiry (a loaded
# CI machine once kept a critical request queued past its 2 s)
PATIENT_TIERS = TierTable(tuple(replace(t, max_queue_ms=600_000.0) for t in URGENT_TIERS.tiers))


def mk(model, pools, prefix=False, policy: PreemptionPolicy | None = PreemptionPolicy()):  # noqa: F811
    slots = sum(c for _, c in pools)
    runner = ModelRunner(model, slots=slots, max_len=128, kv_buckets=BUCKETS, pools=pools)
    e = Engine(runner, lambda t: bytes([97 + t % 26]), {EOS}, BUCKETS, preemption=policy, tiers=PATIENT_TIERS)
    if prefix:
        e.prefix_cache = PrefixCache(runner, 32, 16, "fingerprint")
    return e


@pytest.fixture(scope="module")
def uninterrupted() -> dict:
    """Tokens of uninterrupted runs, by (prompt, max_tokens), computed once per module."""
    return {}


def reference(model, cache: dict, prompt: list[int], n: int) -> list[int]:  # noqa: F811
    key = (tuple(prompt), n)
    if key not in cache:
        engine = mk(model, [(128, 1)], policy=None)
        sink = RecordingSink()
        engine.submit(request(prompt, sink, rid="a", max_tokens=n, deadline=FAR, priority=4, tier="batch"))
        run_until_idle(engine)
        cache[key] = sink.tokens
    return cache[key]


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("prefix", [False, True])
def test_resumed_requests_give_uninterrupted_tokens_and_leave_nothing_behind(
    model,  # noqa: F811
    uninterrupted,
    seed,
    prefix,
):
    rng = random.Random(seed)
    pools = rng.choice([[(128, 2)], [(32, 1), (128, 1)], [(32, 2), (128, 2)], [(64, 1), (128, 2)]])
    e = mk(model, pools, prefix)
    subs = []
    for step in range(60):
        if rng.random() < 0.3:
            tier = rng.choice(["critical", "standard", "batch", "batch"])
            plen = rng.choice([3, 10, 20, 36, 50])
            prompt = [1] + [rng.randrange(3, 299) for _ in range(plen - 1)]
            n = rng.choice([3, 8, 20, 40])
            if plen + n > 128:
                n = 128 - plen
            pr = {"critical": 1, "standard": 3, "batch": 4}[tier]
            dl = time.time_ns() if tier == "critical" else FAR
            s = RecordingSink()
            e.submit(
                request(prompt, s, rid=f"r{len(subs)}", priority=pr, tier=tier, deadline=dl, max_tokens=n)
            )
            subs.append((s, prompt, n))
        e.step()
    run_until_idle(e, 2000)
    for s, prompt, n in subs:
        assert s.finished and not s.errors, s.errors
        assert sum(1 for *_, f in s.windows if f) == 1
        assert s.tokens == reference(model, uninterrupted, prompt, n), (prompt, n)
    assert sorted(e._free) == list(range(e.runner.slots)) and not e._active and not e._suspended
    assert not e._queue and not e._pending_stores
    assert sum(e.stats.finished.values()) == len(subs), e.stats.finished
    assert e.stats.preemptions == e.stats.resumes
