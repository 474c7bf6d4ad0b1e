"""KV slot pools per length class, planned from the sequence lengths traffic reserved.

One pool of `max_len` slots reserves the longest sequence for every request, though most need a
fraction of it. Here each class (cut at percentiles of the recorded reserved lengths: prompt plus
max_tokens) gets its own pool, and pools are sized by tail coverage: the slots able to hold a
length above a class boundary are at least that tail's share of the predicted concurrent peak,
rounded up. A request takes the smallest free slot that fits it, so short requests may spill into
longer pools but never the other way, and the longest class always has a slot.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from scheduler.warmup_planner import percentile_length

DEFAULT_CLASS_PERCENTILES = (50.0, 90.0, 99.0)


@dataclass(frozen=True)
class KVPool:
    capacity: int  # tokens each slot of the pool can hold
    slots: int


@dataclass(frozen=True)
class KVPoolPlan:
    pools: tuple[KVPool, ...]  # ascending capacity; the last one holds max_len
    source: str  # "traffic" or "single" (no usable history: one pool of max_len)
    samples: int = 0
    cuts: dict[str, int] = field(default_factory=dict)  # "p50" -> reserved length at that percentile

    @property
    def slots(self) -> int:
        return sum(pool.slots for pool in self.pools)

    @property
    def slot_tokens(self) -> int:
        """Token positions reserved over all slots (KV bytes are this times bytes per token)."""
        return sum(pool.capacity * pool.slots for pool in self.pools)

    @property
    def single_pool_tokens(self) -> int:
        """What the same slots would reserve as one pool of the longest capacity."""
        return self.slots * self.pools[-1].capacity

    def as_dict(self) -> dict:
        return {
            "source": self.source,
            "samples": self.samples,
            "cuts": self.cuts,
            "pools": [{"capacity": p.capacity, "slots": p.slots} for p in self.pools],
            "slot_tokens": self.slot_tokens,
            "single_pool_tokens": self.single_pool_tokens,
        }


def single_pool(slots: int, max_len: int, samples: int = 0) -> KVPoolPlan:
    return KVPoolPlan((KVPool(max_len, slots),), "single", samples)


def _class_of(length: int, buckets: Sequence[int]) -> int:
    return next(b for b in buckets if b >= length)


def plan_kv_pools(
    reserved_lengths: Mapping[int, int] | None,
    slots: int,
    max_len: int,
    buckets: Sequence[int],
    *,
    percentiles: Sequence[float] = DEFAULT_CLASS_PERCENTILES,
    min_samples: int = 50,
) -> KVPoolPlan:
    """Pools for `slots` concurrent requests. Capacities are KV buckets (so a pool's own limit
    never creates a kernel shape that warmup skipped), one per percentile cut plus `max_len`.

    `reserved_lengths` is the histogram {prompt + max_tokens: count}. Fewer than `min_samples`
    requests, or a single slot, gives one pool of `max_len`: classes cannot be sized from that.
    """
    if slots < 1:
        raise ValueError(f"a KV plan needs at least one slot, got {slots}")
    classes = sorted({b for b in buckets if 0 < b < max_len} | {max_len})
    clean: Counter[int] = Counter()  # lengths past max_len all count as max_len: added, not overwritten
    for k, v in (reserved_lengths or {}).items():
        if int(k) > 0 and int(v) > 0:
            clean[min(int(k), max_len)] += int(v)
    samples = sum(clean.values())
    if samples < max(min_samples, 1) or slots < 2:  # no recorded request is no distribution
        return single_pool(slots, max_len, samples)
    cuts = {f"p{p:g}": percentile_length(clean, p) for p in percentiles}
    capacities = sorted({_class_of(length, classes) for length in cuts.values()} | {max_len})
    covering = [slots]  # covering[i]: slots that must hold lengths above capacities[i - 1]
    for boundary in capacities[:-1]:
        above = sum(count for length, count in clean.items() if length > boundary)
        # integer ceil of slots * above / samples: a float less 1e-9 rounded down past ~1e9 samples
        covering.append(max(1, min(covering[-1], -(-slots * above // samples))))
    covering.append(0)
    pools = tuple(
        KVPool(capacity, covering[i] - covering[i + 1])
        for i, capacity in enumerate(capacities)
        if covering[i] > covering[i + 1]
    )
    return KVPoolPlan(pools, "traffic", samples, cuts)
