"""Feedback from observed first-token latency to tier weights and admission thresholds.

At a fixed cadence the scheduler reads each tier's observed TTFT (the percentile its SLO names, or an
exponentially weighted mean) and moves the tier's weight multiplicatively by (observed / target) ** gain:
a tier drifting toward or past its target gains share, one comfortably inside it gives share back.
Multiplicative steps make the loop scale-free (the same gain works for 100 ms and 10 s targets), and in
log space a plant whose latency goes like weight ** -k is a first-order system that converges for
0 < gain * k < 2 and is monotone below 1. Because k is not known, the controller damps itself: when a
tier's successive changes flip sign its gain is halved, and it recovers slowly while they agree. A dead
band keeps noise from moving anything, each step and each weight are bounded, and a window without
observations (e.g. Redis unreachable) keeps the last weights.

How the outputs are used (see `apply_to` and scheduler/slo_queue.py): what matters for a tier is its
pressure relative to the tiers that go before it, `share(t) = weight(t) / max weight above t` (clamped to
`threshold_bounds`; the top tier's is 1). The same share is used twice:
* as the tier's aging rate in `SloQueue.set_tier_weight`: when a higher tier is missing its target the
  lower tiers climb precedence levels more slowly while they wait; when the higher tiers have slack a
  tier under pressure climbs sooner. Fresh requests keep the static tier order, so a critical request
  still goes first, and the wait bound stays computable (aging slows by at most 1 / low bound).
* as the tier's admission threshold (budget = TTFT target x share): when a higher tier is missing its
  target, lower sheddable tiers are shed earlier.
Every change is reported as an `Adaptation` (returned in `last_events`, and passed to `on_event`) so it
can be logged and exported as a metric.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal, Protocol

from scheduler.tiers import TierTable

Kind = Literal["weight", "threshold"]


@dataclass(frozen=True)
class TierObservation:
    """One tier's first-token latency over the last window; `p_target_ms` wins over `ewma_ms` when both."""

    count: int
    p_target_ms: float | None = None
    ewma_ms: float | None = None

    @property
    def value_ms(self) -> float | None:
        value = self.p_target_ms if self.p_target_ms is not None else self.ewma_ms
        if value is None or not math.isfinite(value) or value <= 0:
            return None
        return float(value)


@dataclass(frozen=True)
class Adaptation:
    """One change the controller made: which tier, what, from/to, and why (for logs and metrics)."""

    tier: str
    kind: Kind
    old: float
    new: float
    reason: str
    now_ns: int


class _WeightSink(Protocol):
    def set_tier_weight(self, tier: str, weight: float) -> None: ...


class _ThresholdSink(Protocol):
    def set_threshold(self, tier_name: str, multiplier: float) -> float: ...


class FeedbackController:
    """Adapts per-tier weights from observed TTFT; see the module docstring for the control law.

    `dead_band`: relative error |observed/target - 1| below which nothing moves.
    `max_step`: the largest factor one update may apply (and 1/max_step the smallest).
    `min_count`: observations needed in a window before a tier's figure is trusted.
    """

    def __init__(
        self,
        tiers: TierTable,
        gain: float = 0.5,
        min_weight: float = 0.1,
        max_weight: float = 10.0,
        *,
        dead_band: float = 0.1,
        max_step: float = 2.0,
        min_count: int = 1,
        threshold_bounds: tuple[float, float] = (0.25, 2.0),
        on_event: Callable[[Adaptation], None] | None = None,
    ) -> None:
        if not gain > 0:
            raise ValueError(f"gain must be > 0, got {gain!r}")
        if not 0 < min_weight <= 1.0 <= max_weight:
            raise ValueError(f"need 0 < min_weight <= 1 <= max_weight, got {min_weight!r}, {max_weight!r}")
        if dead_band < 0 or max_step <= 1.0:
            raise ValueError(f"need dead_band >= 0 and max_step > 1, got {dead_band!r}, {max_step!r}")
        self.tiers = tiers
        self.gain = float(gain)
        self.min_weight = float(min_weight)
        self.max_weight = float(max_weight)
        self.dead_band = float(dead_band)
        self.max_step = float(max_step)
        self.min_count = int(min_count)
        self.threshold_bounds = threshold_bounds
        self.on_event = on_event
        self._weights = {t.name: 1.0 for t in tiers}
        self._thresholds = {t.name: 1.0 for t in tiers}
        self._gains = {t.name: self.gain for t in tiers}
        self._last_sign = {t.name: 0 for t in tiers}
        self.last_events: tuple[Adaptation, ...] = ()

    @property
    def weights(self) -> dict[str, float]:
        return dict(self._weights)

    @property
    def thresholds(self) -> dict[str, float]:
        return dict(self._thresholds)

    def update(self, observed: Mapping[str, TierObservation], now_ns: int) -> dict[str, float]:
        """Fold one window of observations into the weights; returns all tier weights now in effect.

        Tiers without (enough) observations keep their weight. The changes made are in `last_events`.
        """
        events: list[Adaptation] = []
        for tier in self.tiers:
            obs = observed.get(tier.name)
            value = obs.value_ms if obs is not None and obs.count >= self.min_count else None
            if value is None:
                continue
            ratio = value / tier.ttft_target_ms
            if abs(ratio - 1.0) <= self.dead_band:
                continue
            gain = self._gains[tier.name]
            factor = min(self.max_step, max(1.0 / self.max_step, ratio**gain))
            old = self._weights[tier.name]
            new = min(self.max_weight, max(self.min_weight, old * factor))
            if new == old:
                continue  # pinned at a bound
            sign = 1 if new > old else -1
            if self._last_sign[tier.name] == -sign:
                self._gains[tier.name] = max(self.gain / 16.0, gain * 0.5)  # it overshot: damp
            else:
                self._gains[tier.name] = min(self.gain, gain * 1.25)
            self._last_sign[tier.name] = sign
            self._weights[tier.name] = new
            events.append(
                Adaptation(
                    tier.name,
                    "weight",
                    old,
                    new,
                    f"observed {value:.1f} ms vs target {tier.ttft_target_ms:g} ms (ratio {ratio:.2f}, "
                    f"gain {gain:.3f}, {obs.count if obs else 0} samples)",
                    now_ns,
                )
            )
        events.extend(self._update_thresholds(now_ns))
        self.last_events = tuple(events)
        if self.on_event is not None:
            for event in events:
                self.on_event(event)
        return self.weights

    def apply_to(self, queue: _WeightSink | None = None, admission: _ThresholdSink | None = None) -> None:
        """Push each tier's share into a queue (aging rate) and an admission controller (threshold).
        Tiers of one priority share the queue's level, so one aging rate: the largest of their shares,
        so that a tier meeting its target never slows the aging of one that misses it."""
        if queue is not None:
            level_share: dict[int, tuple[float, str]] = {}
            for tier in self.tiers:
                level_share[tier.priority] = max(
                    level_share.get(tier.priority, (0.0, "")), (self._thresholds[tier.name], tier.name)
                )
            for share, name in level_share.values():
                queue.set_tier_weight(name, share)
        if admission is not None:
            for name, threshold in self._thresholds.items():
                admission.set_threshold(name, threshold)

    def _update_thresholds(self, now_ns: int) -> list[Adaptation]:
        """threshold(t) = weight(t) / max weight above t, clamped; the top tier's stays 1."""
        lo, hi = self.threshold_bounds
        events = []
        for tier in self.tiers:
            above = [self._weights[t.name] for t in self.tiers if t.priority < tier.priority]
            new = 1.0 if not above else min(hi, max(lo, self._weights[tier.name] / max(above)))
            old = self._thresholds[tier.name]
            if abs(new - old) > 1e-9:
                self._thresholds[tier.name] = new
                events.append(
                    Adaptation(
                        tier.name,
                        "threshold",
                        old,
                        new,
                        f"weight {self._weights[tier.name]:.3f} vs largest weight above {max(above):.3f}"
                        if above
                        else "top tier",
                        now_ns,
                    )
                )
        return events
