"""Feedback controller: direction, dead band, bounds, memory without data, convergence without oscillation."""

from __future__ import annotations

import math

import pytest

from scheduler.admission import AdmissionController
from scheduler.feedback import Adaptation, FeedbackController, TierObservation
from scheduler.slo_queue import SloQueue
from scheduler.tiers import TierTable

TIERS = TierTable.defaults()


def obs(ms: float, count: int = 100) -> TierObservation:
    return TierObservation(count=count, p_target_ms=ms)


def test_weight_moves_toward_pressure_and_back() -> None:
    ctl = FeedbackController(TIERS, gain=0.5)
    weights = ctl.update({"critical": obs(480.0), "standard": obs(125.0)}, now_ns=1)
    assert weights["critical"] == pytest.approx(2.0)  # (480/120) ** 0.5
    assert weights["standard"] == pytest.approx(0.5)  # (125/500) ** 0.5
    assert weights["batch"] == 1.0 and weights["warmup"] == 1.0
    kinds = {(e.tier, e.kind) for e in ctl.last_events}
    assert ("critical", "weight") in kinds and ("standard", "weight") in kinds
    event = next(e for e in ctl.last_events if e.tier == "critical" and e.kind == "weight")
    assert (event.old, event.new, event.now_ns) == (1.0, pytest.approx(2.0), 1)
    assert "observed 480.0 ms vs target 120 ms" in event.reason


def test_dead_band_min_count_and_ewma() -> None:
    ctl = FeedbackController(TIERS, dead_band=0.1, min_count=5)
    assert ctl.update({"critical": obs(125.0)}, now_ns=1)["critical"] == 1.0  # within 10 %
    assert ctl.update({"critical": obs(1000.0, count=4)}, now_ns=2)["critical"] == 1.0  # too few samples
    assert ctl.last_events == ()
    weights = ctl.update({"critical": TierObservation(count=10, ewma_ms=30.0)}, now_ns=3)
    assert weights["critical"] == pytest.approx(0.5)


def test_steps_and_weights_are_bounded() -> None:
    ctl = FeedbackController(TIERS, gain=1.0, min_weight=0.2, max_weight=3.0, max_step=2.0)
    assert ctl.update({"critical": obs(120_000.0)}, now_ns=1)["critical"] == 2.0  # one step at most x2
    assert ctl.update({"critical": obs(120_000.0)}, now_ns=2)["critical"] == 3.0  # never above max
    ctl.update({"critical": obs(120_000.0)}, now_ns=3)
    assert ctl.last_events == ()  # pinned at the bound: nothing changed, nothing reported
    for i in range(10):
        ctl.update({"critical": obs(1.0)}, now_ns=4 + i)
    assert ctl.weights["critical"] == 0.2


def test_no_observations_keeps_the_last_weights() -> None:
    seen: list[Adaptation] = []
    ctl = FeedbackController(TIERS, on_event=seen.append)
    before = ctl.update({"critical": obs(480.0)}, now_ns=1)
    assert seen and seen == list(ctl.last_events)
    assert ctl.update({}, now_ns=2) == before
    assert ctl.last_events == () and len(seen) == len([e for e in seen if e.now_ns == 1])


def test_thresholds_and_aging_follow_relative_pressure() -> None:
    ctl = FeedbackController(TIERS, gain=1.0)
    ctl.update({"critical": obs(240.0), "batch": obs(2500.0)}, now_ns=1)  # critical x2, batch x0.5
    assert ctl.thresholds["critical"] == 1.0
    assert ctl.thresholds["warmup"] == pytest.approx(0.5)
    assert ctl.thresholds["batch"] == pytest.approx(0.25)
    assert any(e.kind == "threshold" and e.tier == "batch" for e in ctl.last_events)
    queue: SloQueue[str] = SloQueue(TIERS, aging_ns=1_000_000_000)
    admission = AdmissionController(TIERS)
    ctl.apply_to(queue, admission)
    assert admission.thresholds["batch"] == pytest.approx(0.25)
    assert queue.tier_weight("batch") == pytest.approx(0.25)
    assert queue.tier_aging_ns("batch") == 4_000_000_000  # batch ages 4x slower while critical suffers


def run_plant(exponent: float, gain: float, steps: int = 80) -> tuple[list[float], list[float]]:
    """A tier whose observed latency responds to its weight: latency = base * weight ** -exponent.

    The fixed point is the weight at which latency equals the target (here 4 ** (1 / exponent)).
    Returns the weight after each update and the observed latency fed into it.
    """
    target = TIERS.get("standard").ttft_target_ms
    base = 4.0 * target
    ctl = FeedbackController(TIERS, gain=gain, min_weight=0.01, max_weight=100.0, dead_band=0.05)
    weights, latencies = [], []
    for step in range(steps):
        latency = base * ctl.weights["standard"] ** -exponent
        latencies.append(latency)
        weights.append(ctl.update({"standard": obs(latency)}, now_ns=step)["standard"])
    return weights, latencies


def sign_flips(weights: list[float]) -> int:
    deltas = [b - a for a, b in zip([1.0] + weights, weights) if b != a]
    return sum(1 for a, b in zip(deltas, deltas[1:]) if (a > 0) != (b > 0))


@pytest.mark.parametrize("exponent", [0.5, 1.0, 2.0, 3.0, 6.0])
def test_feedback_converges_without_oscillating(exponent: float) -> None:
    """Gain x sensitivity runs from 0.25 (slow, monotone) to 3 (an undamped loop would diverge)."""
    weights, latencies = run_plant(exponent, gain=0.5)
    fixed_point = 4.0 ** (1.0 / exponent)
    settled = weights[-20:]
    assert max(settled) == min(settled)  # it stopped moving
    assert abs(math.log(settled[-1] / fixed_point)) <= 0.05 / exponent + 1e-9  # within the dead band
    target = TIERS.get("standard").ttft_target_ms
    assert abs(latencies[-1] / target - 1.0) <= 0.06
    assert sign_flips(weights) <= 3


def test_tiers_sharing_a_priority_age_as_fast_as_the_one_most_behind() -> None:
    """Found in review: tiers of one priority share the queue's level, and so one aging rate. Each tier's
    share was pushed in turn and the last won, so a tier meeting its target could slow the aging of
    one that misses it (here "silver", pushed after "gold"). The level now takes the larger share."""
    table = TierTable.from_mapping(
        {
            "default_tier": "gold",
            "tiers": {
                "critical": {"priority": 1, "ttft_target_ms": 100},
                "gold": {"priority": 2, "ttft_target_ms": 200},
                "silver": {"priority": 2, "ttft_target_ms": 200},
                "warmup": {"priority": 3, "ttft_target_ms": 1000},
            },
        }
    )
    ctl = FeedbackController(table, gain=1.0)
    ctl.update({"gold": obs(800.0), "silver": obs(50.0)}, now_ns=1)  # gold far behind, silver well ahead
    shares = ctl.thresholds
    assert shares["gold"] > 1.0 > shares["silver"]
    queue = SloQueue(table)
    ctl.apply_to(queue)
    assert queue.tier_weight("gold") == queue.tier_weight("silver") == shares["gold"]
