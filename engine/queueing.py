"""The engine's admission queue under a chosen policy, and the load figures admission control needs.

A decoupled engine leaves Triton's own queue empty, so precedence is decided here. The policies
exist side by side so the scheduler benchmark can compare them on the same arrivals:
  fifo      arrival order
  priority  tier precedence, arrival order within a tier (static priority, no aging)
  edf       earliest first-token deadline, tiers ignored
  slo       tier precedence with aging, EDF within a tier, per-tenant fair share (scheduler/slo_queue.py)

Under every policy a queued request expires at its tier's `max_queue_ms` after it arrived: its client
has most likely given up, and a cancel is not seen while a request is queued (docs/INTERNALS.md), so
running it late would spend a prefill on nobody and make the queue behind it later still.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from engine.requests import EngineRequest
from scheduler.slo_queue import SloQueue
from scheduler.tiers import Tier, TierTable

POLICIES = ("fifo", "priority", "edf", "slo")


@dataclass
class Ewma:
    """Exponentially weighted mean of a measured rate or duration; None until the first sample."""

    alpha: float = 0.2
    value: float | None = None

    def update(self, sample: float) -> None:
        self.value = sample if self.value is None else (1 - self.alpha) * self.value + self.alpha * sample

    def get(self, default: float) -> float:
        return default if self.value is None else self.value


class PolicyQueue:
    """One SloQueue configured per policy, with the push keys that policy orders by."""

    def __init__(self, policy: str, tiers: TierTable, max_len: int | None):
        if policy not in POLICIES:
            raise ValueError(f"queue_policy={policy!r}; allowed: {', '.join(POLICIES)}")
        self.policy = policy
        full = policy == "slo"
        self.queue: SloQueue[EngineRequest] = SloQueue(
            tiers, aging_ns=None if full else 0, fair_share=full, max_len=max_len
        )
        self.flat_priority = tiers.default.priority
        self.tiers = tiers

    def expires_ns(self, request: EngineRequest) -> int:
        """When, on the queue's clock (monotonic), the request has waited its tier's `max_queue_ms` since
        it arrived (in the scheduler step, when it says so: wall clock). An unknown tier: the default's."""
        tier = self._tier(request)
        arrived = request.arrived_ns
        waited = max(0, time.time_ns() - arrived) if arrived else 0
        return time.monotonic_ns() + tier.max_queue_ns - waited

    def requeue_expires_ns(self, request: EngineRequest) -> int:
        """When a suspended request, requeued now, has waited its tier's `max_queue_ms` again."""
        return time.monotonic_ns() + self._tier(request).max_queue_ns

    def _tier(self, request: EngineRequest) -> Tier:
        """The request's tier; an unknown one: the default's."""
        tiers = self.tiers
        return tiers.get(request.params.tier) if request.params.tier in tiers.names else tiers.default

    def push(self, request: EngineRequest, requeue: bool = False) -> int:
        """Queue `request`; returns when it expires (`expires_ns`). `requeue`: a suspended request coming
        back; it was admitted once, so capacity never refuses it, and it expires its tier's
        `max_queue_ms` after its suspension: under a stream of more urgent requests it would otherwise
        wait forever, its first token long sent."""
        priority, deadline = request.priority, request.deadline_ns
        if self.policy in ("fifo", "edf"):
            priority = self.flat_priority
        if self.policy in ("fifo", "priority"):
            deadline = request.received_ns
        cost = len(request.prompt_ids) + request.params.max_tokens
        expires = self.requeue_expires_ns(request) if requeue else self.expires_ns(request)
        self.queue.push(
            request, priority, deadline, key=request.request_id, tenant=request.params.tenant, cost=cost,
            check_capacity=not requeue, expires_ns=expires, tier=self._tier(request).name,
        )  # fmt: skip
        return expires
