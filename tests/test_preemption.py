"""Preemption: a queued request of a higher tier that would miss its deadline takes a lower tier's slot."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from engine.engine import Engine
from engine.model_runner import ModelRunner
from engine.prefix_cache import PrefixCache
from scheduler.preemption import Contender, PreemptionPolicy, RunningRequest
from scheduler.tiers import TierTable
from tests.test_engine_batching import BUCKETS, EOS, RecordingSink, model, request, run_until_idle  # noqa: F401

FAR = 2**62  # a deadline nobody misses (wall-clock ns)
NOW = 1_000_000_000_000


def running(slot, priority, remaining=50, preemptions=0) -> RunningRequest:
    return RunningRequest(slot, priority, remaining, preemptions)


# ----- policy -------------------------------------------------------------------------------------


def test_no_victim_when_a_slot_frees_in_time():
    head = Contender(priority=1, deadline_ns=NOW + 200_000_000, prefill_s=0.01)
    slots = [running(0, 4, remaining=5), running(1, 4, remaining=50)]
    assert PreemptionPolicy().victim(head, slots, decode_step_s=0.02, now_ns=NOW) is None  # 0.1 s + 0.01 s


def test_lowest_tier_with_most_work_left_yields():
    head = Contender(priority=1, deadline_ns=NOW, prefill_s=0.01)
    slots = [running(0, 3, remaining=90), running(1, 4, remaining=10), running(2, 4, remaining=30)]
    assert PreemptionPolicy().victim(head, slots, decode_step_s=0.02, now_ns=NOW) == 2


def test_equal_or_higher_tiers_and_worn_out_victims_never_yield():
    head = Contender(priority=3, deadline_ns=NOW, prefill_s=0.0)
    policy = PreemptionPolicy(max_preemptions=2)
    assert policy.victim(head, [running(0, 3), running(1, 1)], 0.02, NOW) is None
    assert policy.victim(head, [running(0, 4, preemptions=2)], 0.02, NOW) is None
    assert policy.victim(head, [running(0, 4, preemptions=1)], 0.02, NOW) == 0


def test_free_slot_means_no_preemption_and_bad_settings_are_refused():
    head = Contender(priority=1, deadline_ns=NOW, prefill_s=0.0)
    assert PreemptionPolicy().victim(head, [running(0, 4)], 0.02, NOW, free_slots=1) is None
    with pytest.raises(ValueError, match="max_preemptions"):
        PreemptionPolicy(max_preemptions=-1)
    with pytest.raises(ValueError, match="margin"):
        PreemptionPolicy(margin=0)


# ----- engine -------------------------------------------------------------------------------------


# The engine bounds a request's deadline by its tier's (arrival + ttft_target_ms): a critical target of
# 1 ms makes the critical requests below due at once, which the tiny model's decode could otherwise meet
URGENT_TIERS = TierTable(
    tuple(replace(t, ttft_target_ms=1.0) if t.name == "critical" else t for t in TierTable.defaults().tiers)
)


def critical_request(sink: RecordingSink, max_tokens: int = 3):
    """A critical request due at once (see URGENT_TIERS): it preempts whatever runs in a lower tier."""
    return request(
        [1, 7, 8],
        sink,
        rid="crit",
        priority=1,
        tier="critical",
        deadline=time.time_ns(),
        max_tokens=max_tokens,
    )


def make_engine(model, slots=1, prefix_cache=False, policy=PreemptionPolicy()) -> Engine:  # noqa: F811
    runner = ModelRunner(model, slots=slots, max_len=128, kv_buckets=BUCKETS)
    engine = Engine(
        runner, lambda t: bytes([97 + t % 26]), {EOS}, BUCKETS, preemption=policy, tiers=URGENT_TIERS
    )
    if prefix_cache:
        engine.prefix_cache = PrefixCache(runner, 32, 16, "fingerprint")
    return engine


def alone(model, prompt, **params) -> list[int]:  # noqa: F811
    engine = make_engine(model, policy=None)
    sink = RecordingSink()
    engine.submit(request(prompt, sink, rid="alone", **params))
    run_until_idle(engine)
    return sink.tokens


BATCH_PROMPT = [1] + list(range(40, 75))  # 36 tokens: two full prefix blocks


@pytest.mark.parametrize("prefix_cache", [False, True])
@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "top_p": 0.9, "seed": 11}])
def test_critical_overtakes_a_running_batch_request_which_resumes_unchanged(model, prefix_cache, sampling):  # noqa: F811
    engine = make_engine(model, prefix_cache=prefix_cache)
    batch, critical = RecordingSink(), RecordingSink()
    engine.submit(
        request(
            BATCH_PROMPT,
            batch,
            rid="batch",
            priority=4,
            tier="batch",
            deadline=FAR,
            max_tokens=30,
            **sampling,
        )
    )
    for _ in range(5):
        engine.step()
    engine.submit(critical_request(critical))
    while not critical.finished:
        engine.step()
    assert not batch.finished, "the critical request finished while the batch request still had work"
    run_until_idle(engine)
    assert engine.stats.preemptions == 1 and engine.stats.resumes == 1
    assert batch.tokens == alone(model, BATCH_PROMPT, max_tokens=30, **sampling)
    assert len(critical.tokens) == 3 and not batch.errors
    if prefix_cache:  # the parked prompt and output blocks came back from the cache, not recomputed
        assert engine.stats.prefix_reused_tokens >= 32


def test_a_suspended_request_that_bypasses_the_caches_leaves_nothing_in_them(model):  # noqa: F811
    engine = make_engine(model, prefix_cache=True)
    batch, critical = RecordingSink(), RecordingSink()
    params = {"priority": 4, "tier": "batch", "deadline": FAR, "max_tokens": 30, "cache": "bypass"}
    engine.submit(request(BATCH_PROMPT, batch, rid="batch", **params))
    for _ in range(5):
        engine.step()
    urgent = {
        "priority": 1,
        "tier": "critical",
        "deadline": time.time_ns(),
        "max_tokens": 3,
        "cache": "bypass",
    }
    engine.submit(request([1, 7, 8], critical, rid="crit", **urgent))
    run_until_idle(engine)
    assert engine.stats.preemptions == 1 and engine.stats.resumes == 1
    assert batch.tokens == alone(model, BATCH_PROMPT, max_tokens=30) and not engine.prefix_cache.index


def test_no_preemption_when_the_deadline_allows_waiting(model):  # noqa: F811
    engine = make_engine(model)
    batch, standard = RecordingSink(), RecordingSink()
    engine.submit(
        request(BATCH_PROMPT, batch, rid="batch", priority=4, tier="batch", deadline=FAR, max_tokens=10)
    )
    engine.step()
    engine.submit(
        request([1, 7, 8], standard, rid="std", priority=3, tier="standard", deadline=FAR, max_tokens=3)
    )
    run_until_idle(engine)
    assert engine.stats.preemptions == 0
    assert batch.windows[-1][2] and standard.windows[-1][2]


def test_preemption_off_keeps_the_slot(model):  # noqa: F811
    engine = make_engine(model, policy=None)
    batch, critical = RecordingSink(), RecordingSink()
    engine.submit(
        request(BATCH_PROMPT, batch, rid="batch", priority=4, tier="batch", deadline=FAR, max_tokens=10)
    )
    engine.step()
    engine.submit(
        request([1, 7, 8], critical, rid="crit", priority=1, tier="critical", deadline=0, max_tokens=3)
    )
    while not critical.windows:
        engine.step()
    assert batch.finished and engine.stats.preemptions == 0


def test_a_request_is_suspended_at_most_max_preemptions_times(model):  # noqa: F811
    engine = make_engine(model, policy=PreemptionPolicy(max_preemptions=1))
    batch = RecordingSink()
    engine.submit(
        request(BATCH_PROMPT, batch, rid="batch", priority=4, tier="batch", deadline=FAR, max_tokens=40)
    )
    engine.step()
    for i in range(3):
        engine.submit(
            request(
                [1, 7, 8 + i],
                RecordingSink(),
                rid=f"crit{i}",
                priority=1,
                tier="critical",
                deadline=0,
                max_tokens=2,
            )
        )
        for _ in range(4):
            engine.step()
    run_until_idle(engine)
    assert engine.stats.preemptions == 1
    assert batch.finished and len(batch.tokens) == 40


def test_cancelling_a_suspended_request_frees_it(model):  # noqa: F811
    engine = make_engine(model)
    batch, critical = RecordingSink(), RecordingSink()
    engine.submit(
        request(BATCH_PROMPT, batch, rid="batch", priority=4, tier="batch", deadline=FAR, max_tokens=30)
    )
    engine.step()
    engine.submit(
        request([1, 7, 8], critical, rid="crit", priority=1, tier="critical", deadline=0, max_tokens=6)
    )
    engine.step()
    assert engine.stats.preemptions == 1
    batch.cancel = True
    run_until_idle(engine)
    assert batch.errors and batch.errors[0][0] == "CANCELLED"
    assert not engine._suspended and engine.load() == (0, 0)


def test_a_preempted_warmup_request_parks_its_prompt_as_warmup_traffic(model):  # noqa: F811
    """Warmup traffic writes its blocks to L3 at once (`publish`); a preemption between its first token and
    its prompt's store parked the blocks without that flag, so they reached L3 only on a later reuse."""
    engine = make_engine(model, prefix_cache=True)
    warmup = RecordingSink()
    engine.submit(
        request([1, *range(40, 75)], warmup, rid="w", priority=2, tier="warmup", deadline=FAR, max_tokens=30)
    )
    engine._admit()  # its first token; its prompt's store waits for the next step's launch
    published: list[bool] = []
    store = engine.prefix_cache.store
    engine.prefix_cache.store = lambda *args, **kwargs: (
        published.append(kwargs.get("publish", False)) or store(*args, **kwargs)
    )
    engine.submit(critical_request(RecordingSink()))
    engine.step()
    assert engine.stats.preemptions == 1 and published[:1] == [True]
