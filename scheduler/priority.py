"""Priority and deadline assignment for a request of a tier.

A decoupled engine's `execute()` returns at once, so Triton's own priority queue stays empty; precedence
is enforced by the engine's queue (scheduler/slo_queue.py) from these two numbers: lowest priority number
first (Triton's convention, 1 = highest), earliest deadline first within a priority.
"""

from __future__ import annotations

from scheduler.tiers import Tier


def assign(tier: Tier, arrival_ns: int) -> tuple[int, int]:
    """(priority, deadline_ns): the tier's precedence, and when its first token is due."""
    return tier.priority, int(arrival_ns) + tier.ttft_target_ns
