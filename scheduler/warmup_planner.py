"""Warmup plans from recorded traffic: prompt-length buckets and KV reserve.

Buckets are cut at percentiles of the prompt lengths a model has served, so warmup spends its
budget on the shapes traffic actually reaches; the sequence limit is always a bucket, so no length
meets a shape that was never warmed. Without history the configured defaults are used.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction

DEFAULT_PERCENTILES = (50.0, 90.0, 95.0, 99.0, 100.0)


@dataclass(frozen=True)
class BucketPlan:
    buckets: tuple[int, ...]
    source: str  # "traffic" or "default"
    samples: int = 0
    cuts: dict[str, int] = field(default_factory=dict)  # "p50" -> prompt length at that percentile


def percentile_length(histogram: Mapping[int, int], percentile: float) -> int:
    """Smallest length L such that at least `percentile`% of requests were <= L (nearest rank)."""
    total = sum(histogram.values())
    if total <= 0:
        raise ValueError("percentile of an empty histogram")
    # exact: a float product is off by one rank once counts pass ~1e14 (0.95 * total rounds down)
    rank = max(1, math.ceil(Fraction(percentile) * total / 100))
    seen = 0
    for length in sorted(histogram):
        seen += histogram[length]
        if seen >= rank:
            return length
    return max(histogram)


def _align(length: int, align: int) -> int:
    return max(align, -(-length // align) * align)


def plan_buckets(
    histogram: Mapping[int, int] | None,
    max_len: int,
    defaults: Sequence[int],
    *,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
    min_samples: int = 50,
    align: int = 16,
    max_ratio: float = 2.0,
) -> BucketPlan:
    """Buckets at the traffic's percentiles (aligned up), filled from `align` upwards so that
    neighbours differ by at most about `max_ratio` (bounding padding waste), plus `max_len`.

    Fewer than `min_samples` recorded prompts is not a distribution yet: the defaults are used.
    """
    clean = {int(k): int(v) for k, v in (histogram or {}).items() if 0 < int(k) <= max_len and int(v) > 0}
    samples = sum(clean.values())
    if samples < max(min_samples, 1):  # no prompt at all is no distribution, whatever min_samples says
        buckets = sorted({b for b in defaults if 0 < b < max_len} | {max_len})
        return BucketPlan(tuple(buckets), "default", samples)
    cuts = {f"p{p:g}": percentile_length(clean, p) for p in percentiles}
    anchors = sorted(
        {min(align, max_len)} | {min(_align(length, align), max_len) for length in cuts.values()} | {max_len}
    )
    buckets = [anchors[0]]
    for anchor in anchors[1:]:
        buckets.extend(_geometric_fill(buckets[-1], anchor, max_ratio, align))
    return BucketPlan(tuple(sorted(set(buckets))), "traffic", samples, cuts)


def _geometric_fill(low: int, high: int, max_ratio: float, align: int) -> list[int]:
    """Buckets after `low` up to `high`, evenly spaced on a log scale, neighbours <= max_ratio apart
    (before alignment), so short prompts below the p50 cut are not all padded up to it."""
    steps = max(1, math.ceil(math.log(high / low) / math.log(max_ratio) - 1e-9))
    # at most `high`: an unaligned max_len would otherwise be passed by the bucket rounded up before it
    return [min(high, _align(round(low * (high / low) ** (i / steps)), align)) for i in range(1, steps)] + [
        high
    ]


def predict_reserve(
    peaks: Sequence[tuple[float, float]], now: float, half_life_s: float, headroom: float
) -> float:
    """Expected peak from recorded (timestamp, peak) pairs, recent peaks weighted more.

    A weighted maximum: each peak counts with weight 2^(-age / half_life), and the prediction is
    the largest weighted peak times `headroom`, so yesterday's spike still matters but less than
    this morning's.
    """
    if not peaks:
        return 0.0
    weighted = [value * 0.5 ** (max(0.0, now - stamp) / half_life_s) for stamp, value in peaks]
    return max(weighted) * headroom
