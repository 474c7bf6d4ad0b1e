"""TTFT-driven admission control: predict a request's wait from the engine's state, shed what cannot make it.

Queueing a request that will miss its deadline anyway only delays everyone behind it (vLLM's
`max_num_queued_tokens` and the Gateway API inference extension's saturation detection make the same
argument). So before a request is queued we predict when its first token would leave: the prefill work
queued at its precedence or higher, divided by the measured prefill rate, plus the wait for a free slot
when all are busy, plus its own prefill. A sheddable tier's request whose prediction exceeds its budget
(TTFT target x an admission threshold the feedback controller tunes) is refused with UNAVAILABLE, and so
is any request whose tier queue is full. Non-sheddable requests are never refused for being late: they
are admitted and the decision records that they are predicted late. Nothing is dropped silently: every
refusal carries a message naming the tier, the reason and when to retry.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from scheduler.errors import RequestError
from scheduler.tiers import Tier, TierTable

Reason = Literal["admitted", "predicted-late", "deadline", "queue-full"]


@dataclass(frozen=True)
class EngineLoad:
    """A snapshot of the engine's state, as measured by the engine (per tier where it matters).

    `queued_prefill_tokens` and `queued_requests` are keyed by tier name (a tier missing means 0).
    `mean_remaining_decode_steps`: average decode steps left for the running requests;
    `mean_output_tokens`: a typical request's decode steps, for requests that start after those finish.
    """

    slots: int
    running_requests: int
    prefill_tokens_per_s: float
    decode_step_s: float
    queued_prefill_tokens: Mapping[str, int] = field(default_factory=dict)
    queued_requests: Mapping[str, int] = field(default_factory=dict)
    mean_remaining_decode_steps: float = 0.0
    mean_output_tokens: float = 0.0

    def __post_init__(self) -> None:
        if self.slots < 1:
            raise ValueError(f"slots must be >= 1, got {self.slots!r}")
        if self.running_requests < 0:
            raise ValueError(f"running_requests must be >= 0, got {self.running_requests!r}")
        if not self.prefill_tokens_per_s > 0:
            raise ValueError(f"prefill_tokens_per_s must be > 0, got {self.prefill_tokens_per_s!r}")
        if self.decode_step_s < 0:
            raise ValueError(f"decode_step_s must be >= 0, got {self.decode_step_s!r}")

    @property
    def total_queued_prefill_tokens(self) -> int:
        return sum(self.queued_prefill_tokens.values())


@dataclass(frozen=True)
class DelayEstimate:
    """The parts of a predicted time to first token, in seconds."""

    prefill_ahead_s: float
    slot_wait_s: float
    own_prefill_s: float
    tokens_ahead: int
    requests_ahead: int

    @property
    def total_s(self) -> float:
        return self.prefill_ahead_s + self.slot_wait_s + self.own_prefill_s


@dataclass(frozen=True)
class Decision:
    """The outcome of `AdmissionController.check`; `error` is set exactly when the request is refused."""

    admitted: bool
    tier: str
    reason: Reason
    predicted_delay_s: float
    budget_s: float
    threshold: float
    retry_after_s: float | None = None
    error: RequestError | None = None

    def raise_if_rejected(self) -> None:
        if self.error is not None:
            raise self.error


class AdmissionController:
    """Admits or sheds requests per tier from a predicted first-token delay; thresholds are tunable.

    `max_queued`: per-tier queue limits by name, or one limit for every tier, or None for unbounded.
    `threshold_bounds`: the range `set_threshold` clamps to; 1.0 means "shed when predicted over target".
    `min_retry_s`: the smallest retry hint given, so clients do not hammer an overloaded replica.
    """

    def __init__(
        self,
        tiers: TierTable,
        *,
        max_queued: Mapping[str, int] | int | None = None,
        threshold_bounds: tuple[float, float] = (0.25, 2.0),
        min_retry_s: float = 0.5,
    ) -> None:
        lo, hi = threshold_bounds
        if not 0 < lo <= 1.0 <= hi:
            raise ValueError(f"threshold_bounds must satisfy 0 < low <= 1 <= high, got {threshold_bounds!r}")
        self.tiers = tiers
        self._bounds = (float(lo), float(hi))
        self._min_retry_s = float(min_retry_s)
        if isinstance(max_queued, Mapping):
            for name in max_queued:
                tiers.get(name)
            self._max_queued: dict[str, int] = {str(k): int(v) for k, v in max_queued.items()}
        elif max_queued is None:
            self._max_queued = {}
        else:
            self._max_queued = {t.name: int(max_queued) for t in tiers}
        self._thresholds: dict[str, float] = {t.name: 1.0 for t in tiers}

    @property
    def thresholds(self) -> dict[str, float]:
        return dict(self._thresholds)

    def threshold(self, tier_name: str) -> float:
        return self._thresholds[self.tiers.get(tier_name).name]

    def set_threshold(self, tier_name: str, multiplier: float) -> float:
        """Set a tier's budget multiplier (clamped to the bounds); returns the value in effect."""
        name = self.tiers.get(tier_name).name
        if not math.isfinite(multiplier):
            raise ValueError(f"threshold for tier {name!r} must be finite, got {multiplier!r}")
        lo, hi = self._bounds
        self._thresholds[name] = min(hi, max(lo, float(multiplier)))
        return self._thresholds[name]

    def estimate(self, load: EngineLoad, tier: Tier, prompt_tokens: int) -> DelayEstimate:
        """Break down the predicted time to first token for a request of `tier` arriving now.

        Work queued at the same or a higher precedence goes first (EDF puts a new arrival behind its own
        tier's backlog, whose deadlines are earlier). Slots free at the rate running requests finish:
        the first `running` releases spread over their mean remaining decode time, later ones take a
        typical request's whole decode time divided among all slots.
        """
        ahead = [t.name for t in self.tiers if t.priority <= tier.priority]
        tokens_ahead = sum(int(load.queued_prefill_tokens.get(n, 0)) for n in ahead)
        requests_ahead = sum(int(load.queued_requests.get(n, 0)) for n in ahead)
        rate = load.prefill_tokens_per_s
        free = max(0, load.slots - load.running_requests)
        need = requests_ahead + 1 - free
        slot_wait = 0.0
        if need > 0:
            remaining_s = load.mean_remaining_decode_steps * load.decode_step_s
            running = max(1, load.running_requests)
            first_wave = min(need, running)
            slot_wait = remaining_s * first_wave / running
            if need > running:
                full_s = max(load.mean_output_tokens, load.mean_remaining_decode_steps) * load.decode_step_s
                slot_wait += (need - running) * full_s / load.slots
        return DelayEstimate(
            prefill_ahead_s=tokens_ahead / rate,
            slot_wait_s=slot_wait,
            own_prefill_s=max(0, int(prompt_tokens)) / rate,
            tokens_ahead=tokens_ahead,
            requests_ahead=requests_ahead,
        )

    def predict_queue_delay_s(self, load: EngineLoad, tier: Tier | str, prompt_tokens: int) -> float:
        """Predicted seconds until this request's first token: backlog ahead, slot wait, its own prefill."""
        tier = tier if isinstance(tier, Tier) else self.tiers.get(tier)
        return self.estimate(load, tier, prompt_tokens).total_s

    def check(
        self,
        tier_name: str | None,
        prompt_tokens: int,
        load: EngineLoad,
        now_ns: int,
        *,
        arrival_ns: int | None = None,
    ) -> Decision:
        """Admit or refuse one request. Refusals carry `RequestError.unavailable` naming tier, why, retry.

        `arrival_ns` (default `now_ns`): when the request arrived, if it already waited upstream; the
        time spent is taken off its budget.
        """
        tier = self.tiers.get(tier_name)
        threshold = self._thresholds[tier.name]
        waited_s = max(0, now_ns - (now_ns if arrival_ns is None else arrival_ns)) / 1e9
        budget_s = tier.ttft_target_ms / 1000.0 * threshold - waited_s
        est = self.estimate(load, tier, prompt_tokens)
        predicted = est.total_s
        context = (
            f"{est.tokens_ahead} prefill tokens and {est.requests_ahead} requests queued at or above its "
            f"precedence, {load.running_requests}/{load.slots} slots busy"
        )
        limit = self._max_queued.get(tier.name)
        queued = int(load.queued_requests.get(tier.name, 0))
        if limit is not None and queued >= limit:
            retry = self._retry(predicted)
            message = (
                f"tier {tier.name!r} request refused: its queue is full ({queued}/{limit} queued); "
                f"predicted first token in {predicted:.3f} s; {context}; retry in {retry:.1f} s"
            )
            return Decision(
                False,
                tier.name,
                "queue-full",
                predicted,
                budget_s,
                threshold,
                retry,
                RequestError.unavailable(message),
            )
        if predicted <= budget_s:
            return Decision(True, tier.name, "admitted", predicted, budget_s, threshold)
        if not tier.sheddable:
            return Decision(True, tier.name, "predicted-late", predicted, budget_s, threshold)
        retry = self._retry(predicted - budget_s)
        message = (
            f"tier {tier.name!r} request shed: predicted first token in {predicted:.3f} s exceeds its "
            f"budget of {max(budget_s, 0.0):.3f} s (TTFT target {tier.ttft_target_ms:g} ms x admission "
            f"threshold {threshold:.2f}); {context}; retry in {retry:.1f} s"
        )
        return Decision(
            False,
            tier.name,
            "deadline",
            predicted,
            budget_s,
            threshold,
            retry,
            RequestError.unavailable(message),
        )

    def _retry(self, seconds: float) -> float:
        """A retry hint: when the backlog that is in the way should have drained, rounded up to 0.1 s."""
        finite = seconds if math.isfinite(seconds) else 0.0  # no figure to go by: the least hint
        return max(self._min_retry_s, math.ceil(max(finite, 0.0) * 10.0) / 10.0)
