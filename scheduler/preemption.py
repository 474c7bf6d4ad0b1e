"""Which running request, if any, gives its slot to a queued request of a higher tier.

Precedence in the queue does not help a critical request that arrives while every slot decodes a
long batch request: without preemption it waits until one finishes, which at a few hundred decode
steps is far past its TTFT target. So when the queue's head outranks a running request and would
miss its deadline waiting for a slot to free on its own, that running request is suspended (vLLM's
recompute preemption: its KV is dropped or parked in the prefix cache, and it resumes later from
its tokens) and the head takes the slot. The victim has already streamed its first token, so
preemption costs it decode time, never TTFT. A request is suspended at most `max_preemptions` times
so that a steady stream of urgent requests cannot keep one request from finishing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RunningRequest:
    """What the policy needs to know about one occupied slot."""

    slot: int
    priority: int  # 1 is the highest precedence
    remaining_steps: int  # decode steps left at most (max_tokens - generated)
    preemptions: int  # times this request was suspended already


@dataclass(frozen=True)
class Contender:
    """The queue's head: the request that would take the freed slot."""

    priority: int
    deadline_ns: int
    prefill_s: float  # predicted prefill time of its uncached prompt


@dataclass(frozen=True)
class PreemptionPolicy:
    max_preemptions: int = 2
    margin: float = 1.0  # > 1 preempts earlier (pessimistic about the slot-free estimate)

    def __post_init__(self) -> None:
        if self.max_preemptions < 0:
            raise ValueError(f"max_preemptions must be >= 0, got {self.max_preemptions!r}")
        if not self.margin > 0:
            raise ValueError(f"margin must be > 0, got {self.margin!r}")

    def victim(
        self,
        head: Contender,
        running: Sequence[RunningRequest],
        decode_step_s: float,
        now_ns: int,
        free_slots: int = 0,
    ) -> int | None:
        """The slot to suspend for `head`, or None when waiting is good enough or nobody may yield."""
        if free_slots > 0 or not running:
            return None
        soonest_free_s = min(r.remaining_steps for r in running) * decode_step_s * self.margin
        if now_ns + int((soonest_free_s + head.prefill_s) * 1e9) <= head.deadline_ns:
            return None  # a slot frees in time on its own
        eligible = [r for r in running if r.priority > head.priority and r.preemptions < self.max_preemptions]
        if not eligible:
            return None
        chosen = max(eligible, key=lambda r: (r.priority, r.remaining_steps, -r.preemptions, -r.slot))
        return chosen.slot
