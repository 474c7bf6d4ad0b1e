"""The SLO-aware queueing policy (found in review, 2026-12-07): a tier or field written twice in tiers.yaml
was silently replaced (it could switch `restricted` off); `queue full` named the default tier under fifo
and edf; a backfilled request was not charged to its tenant's fair share; the simulator looped forever
with no slot."""

from __future__ import annotations

import pytest

from engine.engine import Engine
from engine.model_runner import ModelRunner
from engine.queueing import PolicyQueue
from scheduler.slo_queue import QueueFull
from scheduler.tiers import TierTable
from tests.test_engine_batching import BUCKETS, EOS, RecordingSink, model, request  # noqa: F401


# 1. tiers.yaml: a tier named twice is silently overwritten


def test_a_tier_named_twice_in_the_tiers_file_is_refused(tmp_path) -> None:
    """PyYAML keeps the last of duplicate mapping keys, so TierTable's own duplicate check never fires:
    the file below silently became critical at priority 5, and (no longer the top tier) unrestricted."""
    path = tmp_path / "tiers.yaml"
    path.write_text(
        "default_tier: standard\n"
        "tiers:\n"
        "  critical: {priority: 1, ttft_target_ms: 120}\n"
        "  standard: {priority: 3, ttft_target_ms: 500}\n"
        "  critical: {priority: 5, ttft_target_ms: 9000}\n"
    )
    with pytest.raises(ValueError, match="critical"):
        TierTable.load(path)


def test_a_key_given_twice_inside_a_tier_is_refused(tmp_path) -> None:
    path = tmp_path / "tiers.yaml"
    path.write_text(
        "tiers:\n"
        "  standard: {priority: 3, ttft_target_ms: 500}\n"
        "  batch: {priority: 4, ttft_target_ms: 5000, priority: 1}\n"
    )
    with pytest.raises(ValueError, match="priority"):
        TierTable.load(path)


def test_cpu_scale_true_is_not_a_number(tmp_path) -> None:
    """Every other numeric field refuses a YAML bool; cpu_scale went through float() first (true -> 1.0)."""
    path = tmp_path / "tiers.yaml"
    path.write_text("cpu_scale: true\ntiers:\n  standard: {priority: 3, ttft_target_ms: 500}\n")
    with pytest.raises(ValueError, match="cpu_scale"):
        TierTable.load(path)


# 2. queue full under fifo/edf names the wrong tier


class _Params:
    def __init__(self, tier: str) -> None:
        self.tier, self.tenant, self.max_tokens = tier, "default", 4


class _Req:
    def __init__(self, rid: str, tier: str, priority: int) -> None:
        self.request_id, self.params, self.priority = rid, _Params(tier), priority
        self.deadline_ns = self.received_ns = self.arrival_ns = 1
        self.prompt_ids = [1, 2]

    @property
    def arrived_ns(self) -> int:
        return self.arrival_ns or self.received_ns


@pytest.mark.parametrize("policy", ["fifo", "edf", "slo", "priority"])
def test_queue_full_names_the_refused_request_s_tier(policy: str) -> None:
    """fifo and edf queue every request at the default tier's priority, and QueueFull took its tier name
    from that priority: a refused critical request was told "tier 'standard' cannot queue another"."""
    tiers = TierTable.defaults()
    queue = PolicyQueue(policy, tiers, max_len=1)
    queue.push(_Req("a", "batch", 4))
    with pytest.raises(QueueFull) as info:
        queue.push(_Req("b", "critical", 1))
    assert info.value.tier == "critical"
    assert "tier 'critical'" in info.value.message


# 3. backfill serves a request without charging its tenant (fair share)


def test_a_backfilled_request_is_charged_to_its_tenant(model) -> None:  # noqa: F811
    """When the queue's head waits for a busy long slot, a later request that fits a free short slot is
    taken out of the queue with `remove` (a cancel), not popped: its tenant's fair-share counter never
    advances, so a tenant of short requests is served for free whenever a long class is busy."""
    runner = ModelRunner(model, slots=2, max_len=128, kv_buckets=BUCKETS, pools=[(32, 1), (128, 1)])
    engine = Engine(runner, lambda t: bytes([97 + t % 26]), {EOS}, BUCKETS)
    sinks = [RecordingSink() for _ in range(3)]
    engine.submit(request([1, *range(10, 50)], sinks[0], rid="first", max_tokens=40, tenant="a"))
    engine.step()  # "first" holds the only long slot
    engine.submit(request([1, *range(60, 100)], sinks[1], rid="waiting", max_tokens=40, tenant="a"))
    engine.submit(request([1, 3, 5], sinks[2], rid="short", max_tokens=4, tenant="b"))
    before = engine._queue.counter("standard", "b")
    engine.step()
    assert {s.request.request_id for s in engine._active.values()} == {"first", "short"}  # backfilled
    assert engine._queue.counter("standard", "b") == pytest.approx(before + 3 + 4)


# 4. simulation: an engine without slots loops forever


@pytest.mark.parametrize("spec", [dict(slots=0), dict(slots=-1), dict(prefill_tokens_per_s=0.0)])
def test_simulation_refuses_an_engine_that_cannot_serve(spec) -> None:
    """EngineSpec(slots=0) under a baseline policy spun forever in `simulate` (queue never popped, nothing
    running, no arrival left); a zero prefill rate raised ZeroDivisionError mid-run. Both should be a
    clear ValueError up front."""
    import threading

    from scheduler.simulation import Arrival, EngineSpec, simulate

    outcome: list[object] = []

    def run() -> None:
        try:
            simulate([Arrival(0, "standard")], TierTable.defaults(), "fifo", EngineSpec(**spec))
            outcome.append("returned")
        except Exception as exc:  # noqa: BLE001
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=5)
    assert outcome, "simulate() did not return within 5 s"
    assert isinstance(outcome[0], ValueError), outcome
