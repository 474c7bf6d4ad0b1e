"""Admission control: delay predicted from engine state; only late sheddable requests and full queues fail."""

from __future__ import annotations

import pytest

from scheduler.admission import AdmissionController, EngineLoad
from scheduler.errors import RequestError
from scheduler.tiers import TierTable

TIERS = TierTable.defaults()


def busy(**overrides: object) -> EngineLoad:
    """8 slots all busy, 1000 tok/s prefill, 20 ms decode steps, 50 steps left on average."""
    fields: dict[str, object] = dict(
        slots=8,
        running_requests=8,
        prefill_tokens_per_s=1000.0,
        decode_step_s=0.02,
        queued_prefill_tokens={"batch": 8000},
        queued_requests={"batch": 20},
        mean_remaining_decode_steps=50,
        mean_output_tokens=100,
    )
    fields.update(overrides)
    return EngineLoad(**fields)  # type: ignore[arg-type]


def test_idle_engine_predicts_only_own_prefill() -> None:
    ctl = AdmissionController(TIERS)
    idle = EngineLoad(slots=4, running_requests=0, prefill_tokens_per_s=1000.0, decode_step_s=0.02)
    assert ctl.predict_queue_delay_s(idle, "batch", 100) == pytest.approx(0.1)
    decision = ctl.check("batch", 100, idle, now_ns=0)
    assert decision.admitted and decision.reason == "admitted" and decision.error is None


def test_prediction_counts_only_work_at_or_above_its_precedence() -> None:
    ctl = AdmissionController(TIERS)
    load = busy()
    critical = ctl.estimate(load, TIERS.get("critical"), 0)
    assert critical.tokens_ahead == 0 and critical.requests_ahead == 0
    assert critical.slot_wait_s == pytest.approx(50 * 0.02 / 8)  # first of 8 running requests to finish
    batch = ctl.estimate(load, TIERS.get("batch"), 0)
    assert batch.prefill_ahead_s == pytest.approx(8.0)
    # 21 slots needed: 8 freed over the running requests' remaining 1 s, 13 more at 2 s / 8 slots each
    assert batch.slot_wait_s == pytest.approx(1.0 + 13 * 2.0 / 8)


def test_sheddable_late_request_is_refused_with_tier_reason_and_retry() -> None:
    ctl = AdmissionController(TIERS)
    decision = ctl.check("batch", 500, busy(), now_ns=0)
    assert not decision.admitted and decision.reason == "deadline"
    assert isinstance(decision.error, RequestError) and decision.error.code == "UNAVAILABLE"
    message = decision.error.message
    assert "'batch'" in message and "exceeds its budget of 5.000 s" in message and "retry in" in message
    assert decision.retry_after_s == pytest.approx(decision.predicted_delay_s - 5.0, abs=0.1)
    assert f"retry in {decision.retry_after_s:.1f} s" in message
    with pytest.raises(RequestError):
        decision.raise_if_rejected()


def test_non_sheddable_late_request_is_admitted_and_marked() -> None:
    ctl = AdmissionController(TIERS)
    load = busy(queued_prefill_tokens={"standard": 8000}, queued_requests={"standard": 20})
    decision = ctl.check("standard", 500, load, now_ns=0)
    assert decision.admitted and decision.reason == "predicted-late" and decision.error is None
    decision.raise_if_rejected()


def test_a_request_that_fits_is_admitted_even_when_sheddable() -> None:
    ctl = AdmissionController(TIERS)
    load = busy(queued_prefill_tokens={"batch": 1000}, queued_requests={"batch": 2})
    assert ctl.check("batch", 100, load, now_ns=0).admitted


def test_full_queue_refuses_any_tier() -> None:
    ctl = AdmissionController(TIERS, max_queued={"critical": 2})
    load = busy(queued_requests={"critical": 2})
    decision = ctl.check("critical", 10, load, now_ns=0)
    assert not decision.admitted and decision.reason == "queue-full"
    assert decision.error is not None and "'critical'" in decision.error.message
    assert "queue is full (2/2 queued)" in decision.error.message and "retry in" in decision.error.message
    assert ctl.check("standard", 10, load, now_ns=0).admitted  # no limit configured for standard
    everyone = AdmissionController(TIERS, max_queued=20)
    assert everyone.check("batch", 10, busy(), now_ns=0).reason == "queue-full"


def test_threshold_moves_the_budget_and_is_clamped() -> None:
    ctl = AdmissionController(TIERS)
    load = busy(queued_prefill_tokens={"batch": 3000}, queued_requests={"batch": 0}, running_requests=0)
    assert ctl.check("batch", 0, load, now_ns=0).admitted  # 3 s predicted, 5 s budget
    assert ctl.set_threshold("batch", 0.5) == 0.5
    shed = ctl.check("batch", 0, load, now_ns=0)
    assert not shed.admitted and shed.budget_s == pytest.approx(2.5)
    assert shed.error is not None and "threshold 0.50" in shed.error.message
    assert ctl.set_threshold("batch", 100.0) == 2.0
    assert ctl.set_threshold("batch", 0.0) == 0.25
    assert ctl.thresholds["batch"] == 0.25 == ctl.threshold("batch")


def test_time_already_waited_comes_off_the_budget() -> None:
    ctl = AdmissionController(TIERS)
    load = busy(queued_prefill_tokens={"batch": 3000}, queued_requests={"batch": 0}, running_requests=0)
    late = ctl.check("batch", 0, load, now_ns=4_000_000_000, arrival_ns=0)
    assert not late.admitted and late.budget_s == pytest.approx(1.0)


def test_unknown_tier_and_bad_load_are_invalid() -> None:
    ctl = AdmissionController(TIERS)
    with pytest.raises(RequestError) as exc:
        ctl.check("gold", 1, busy(), now_ns=0)
    assert exc.value.code == "INVALID_ARG"
    with pytest.raises(ValueError):
        EngineLoad(slots=0, running_requests=0, prefill_tokens_per_s=1.0, decode_step_s=0.0)
    with pytest.raises(ValueError):
        AdmissionController(TIERS, threshold_bounds=(1.5, 2.0))


def test_a_refusal_with_an_unmeasured_decode_time_still_says_when_to_retry():
    """A NaN decode time (no figure yet, or a bad one) made the refusal's retry hint raise: the request
    got an INTERNAL error instead of UNAVAILABLE with a hint."""
    controller = AdmissionController(TierTable.defaults())
    load = EngineLoad(1, 1, 1000.0, float("nan"), queued_requests={"batch": 1}, mean_remaining_decode_steps=5)
    decision = controller.check("batch", 10, load, 0)
    assert not decision.admitted and decision.error is not None and decision.error.code == "UNAVAILABLE"
    assert decision.retry_after_s is not None and decision.retry_after_s > 0
