"""A small discrete-event simulation of one engine, to test and compare scheduling policies offline.

The engine is modelled like engine/engine.py: one serial loop with `slots` KV slots; while a slot is free
and the queue is non-empty it prefills one request (prompt_tokens / prefill rate; the first token leaves
when the prefill ends), otherwise it runs one decode step for all running requests (decode_step_s; every
running request gains a token, finished ones free their slot). Arrivals are open-loop (given up front),
so overload builds queues instead of slowing the clients, as in production.

Policies, all on the same arrivals, queue capacity and max-queue expiry:
* "fifo": arrival order.
* "priority": static tier precedence, arrival order within a tier; no aging, no admission, no feedback.
* "edf": earliest deadline (arrival + tier target) across all tiers.
* "full": SloQueue (precedence + aging + EDF + per-tenant fair share) + AdmissionController +
  FeedbackController at a fixed cadence.
Refusals (admission or full queue) and expiries are recorded, never dropped.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from scheduler.admission import AdmissionController, EngineLoad
from scheduler.errors import RequestError
from scheduler.feedback import Adaptation, FeedbackController, TierObservation
from scheduler.slo_queue import SloQueue
from scheduler.tiers import TierTable

Policy = Literal["fifo", "priority", "edf", "full"]
POLICIES: tuple[Policy, ...] = ("fifo", "priority", "edf", "full")
NS = 1_000_000_000


@dataclass(frozen=True)
class Arrival:
    """One request of the open-loop schedule."""

    at_ns: int
    tier: str
    tenant: str = "default"
    prompt_tokens: int = 128
    output_tokens: int = 32


@dataclass(frozen=True)
class EngineSpec:
    slots: int = 8
    prefill_tokens_per_s: float = 20_000.0
    decode_step_s: float = 0.02

    def __post_init__(self) -> None:
        # with no slot nothing ever leaves the queue: `simulate` would loop forever
        if isinstance(self.slots, bool) or not isinstance(self.slots, int) or self.slots < 1:
            raise ValueError(f"EngineSpec.slots must be an int >= 1, got {self.slots!r}")
        if not (self.prefill_tokens_per_s > 0 and math.isfinite(self.prefill_tokens_per_s)):
            rate = self.prefill_tokens_per_s
            raise ValueError(f"EngineSpec.prefill_tokens_per_s must be finite and > 0, got {rate!r}")
        if not (self.decode_step_s >= 0 and math.isfinite(self.decode_step_s)):
            raise ValueError(f"EngineSpec.decode_step_s must be finite and >= 0, got {self.decode_step_s!r}")


@dataclass(frozen=True)
class SimConfig:
    """Knobs of the full policy; the baselines use only `max_queue_len` (the same capacity for all)."""

    max_queue_len: int | None = 10_000
    aging_ns: int | None = None
    feedback_interval_ns: int = NS
    feedback_gain: float = 0.5
    feedback: bool = True
    admission: bool = True
    fair_share: bool = True
    tenant_weights: Mapping[str, float] = field(default_factory=dict)


@dataclass
class SimRecord:
    """What happened to one request; times in ns on the simulated clock."""

    index: int
    tier: str
    tenant: str
    arrival_ns: int
    start_ns: int | None = None
    first_token_ns: int | None = None
    finish_ns: int | None = None
    rejected: bool = False
    reason: str | None = None
    message: str | None = None

    @property
    def ttft_ns(self) -> int | None:
        return None if self.first_token_ns is None else self.first_token_ns - self.arrival_ns

    @property
    def wait_ns(self) -> int | None:
        return None if self.start_ns is None else self.start_ns - self.arrival_ns


@dataclass
class SimResult:
    policy: Policy
    records: list[SimRecord]
    events: list[Adaptation]
    weights: dict[str, float]
    end_ns: int

    def attainment(self, tiers: TierTable, tier: str) -> float:
        """Share of a tier's requests whose first token met its target; refusals and expiries are misses."""
        target = tiers.get(tier).ttft_target_ns
        mine = [r for r in self.records if r.tier == tier]
        if not mine:
            return 1.0
        met = sum(1 for r in mine if r.ttft_ns is not None and r.ttft_ns <= target)
        return met / len(mine)


@dataclass
class _Running:
    record: SimRecord
    remaining: int


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in (0, 100]); the figure an SLO such as 'P95 <= 120 ms' is checked on."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[rank - 1]


class _Clock:
    def __init__(self) -> None:
        self.now = 0

    def __call__(self) -> int:
        return self.now


def simulate(
    arrivals: Sequence[Arrival],
    tiers: TierTable,
    policy: Policy = "full",
    engine: EngineSpec | None = None,
    config: SimConfig | None = None,
) -> SimResult:
    """Run the arrivals through one simulated engine under `policy`; deterministic for given inputs."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; allowed: {', '.join(POLICIES)}")
    engine = engine or EngineSpec()
    config = config or SimConfig()
    full = policy == "full"
    clock = _Clock()
    queue: SloQueue[int] = SloQueue(
        tiers,
        aging_ns=config.aging_ns if full else 0,
        max_len=config.max_queue_len,
        fair_share=full and config.fair_share,
        clock=clock,
    )
    for tenant, weight in config.tenant_weights.items():
        queue.set_tenant_weight(tenant, weight)
    admission = AdmissionController(tiers) if full and config.admission else None
    feedback = FeedbackController(tiers, gain=config.feedback_gain) if full and config.feedback else None
    order = sorted(range(len(arrivals)), key=lambda i: (arrivals[i].at_ns, i))
    records = [SimRecord(i, a.tier, a.tenant, a.at_ns) for i, a in enumerate(arrivals)]
    events: list[Adaptation] = []
    running: list[_Running] = []
    queued_tokens: dict[str, int] = {t.name: 0 for t in tiers}
    queued_count: dict[str, int] = {t.name: 0 for t in tiers}
    window: dict[str, list[float]] = {t.name: [] for t in tiers}
    next_feedback = config.feedback_interval_ns
    cursor = 0

    def unqueue(i: int) -> None:
        queued_tokens[arrivals[i].tier] -= arrivals[i].prompt_tokens
        queued_count[arrivals[i].tier] -= 1

    def load() -> EngineLoad:
        remaining = [r.remaining for r in running]
        return EngineLoad(
            slots=engine.slots,
            running_requests=len(running),
            prefill_tokens_per_s=engine.prefill_tokens_per_s,
            decode_step_s=engine.decode_step_s,
            queued_prefill_tokens=dict(queued_tokens),
            queued_requests=dict(queued_count),
            mean_remaining_decode_steps=sum(remaining) / len(remaining) if remaining else 0.0,
            mean_output_tokens=sum(a.output_tokens for a in arrivals) / max(1, len(arrivals)),
        )

    def ingest(until_ns: int) -> None:
        nonlocal cursor
        while cursor < len(order) and arrivals[order[cursor]].at_ns <= until_ns:
            i = order[cursor]
            cursor += 1
            arrival, record = arrivals[i], records[i]
            tier = tiers.get(arrival.tier)
            if admission is not None:
                decision = admission.check(
                    tier.name, arrival.prompt_tokens, load(), clock.now, arrival_ns=arrival.at_ns
                )
                if decision.error is not None:
                    record.rejected, record.reason = True, decision.reason
                    record.message = decision.error.message
                    continue
            priority, deadline = {
                "fifo": (1, arrival.at_ns),
                "priority": (tier.priority, arrival.at_ns),
                "edf": (1, arrival.at_ns + tier.ttft_target_ns),
                "full": (tier.priority, arrival.at_ns + tier.ttft_target_ns),
            }[policy]
            try:
                queue.push(
                    i,
                    priority,
                    deadline,
                    key=i,
                    expires_ns=arrival.at_ns + tier.max_queue_ns,
                    tenant=arrival.tenant,
                    cost=arrival.prompt_tokens + arrival.output_tokens,
                    now_ns=arrival.at_ns,
                )
            except RequestError as exc:
                record.rejected, record.reason, record.message = True, "queue-full", exc.message
                continue
            queued_tokens[tier.name] += arrival.prompt_tokens
            queued_count[tier.name] += 1

    def run_feedback() -> None:
        nonlocal next_feedback
        while feedback is not None and clock.now >= next_feedback:
            observed = {
                t.name: TierObservation(len(window[t.name]), percentile(window[t.name], t.percentile))
                for t in tiers
                if window[t.name]
            }
            feedback.update(observed, next_feedback)
            feedback.apply_to(queue, admission)
            events.extend(feedback.last_events)
            for values in window.values():
                values.clear()
            next_feedback += config.feedback_interval_ns

    while cursor < len(order) or queue or running:
        ingest(clock.now)
        run_feedback()
        for entry in queue.pop_expired(clock.now):
            unqueue(entry.item)
            rec = records[entry.item]
            rec.rejected, rec.reason = True, "expired"
            rec.message = f"tier {rec.tier!r} request expired after queueing past its max_queue_ms"
        if queue and len(running) < engine.slots:
            i = queue.pop(clock.now)
            unqueue(i)
            record = records[i]
            record.start_ns = clock.now
            clock.now += round(arrivals[i].prompt_tokens / engine.prefill_tokens_per_s * NS)
            record.first_token_ns = clock.now
            window[record.tier].append((clock.now - record.arrival_ns) / 1e6)
            if arrivals[i].output_tokens <= 1:
                record.finish_ns = clock.now
            else:
                running.append(_Running(record, arrivals[i].output_tokens - 1))
        elif running:
            clock.now += round(engine.decode_step_s * NS)
            for state in running:
                state.remaining -= 1
                if state.remaining <= 0:
                    state.record.finish_ns = clock.now
            running = [s for s in running if s.remaining > 0]
        elif cursor < len(order):
            clock.now = max(clock.now, arrivals[order[cursor]].at_ns)
    weights = feedback.weights if feedback is not None else {t.name: 1.0 for t in tiers}
    return SimResult(policy, records, events, weights, clock.now)
