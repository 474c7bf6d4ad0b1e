"""Open-loop arrival processes: when each request is due, independent of how fast the server answers.

A closed loop (send the next request when one finishes) slows down exactly when the server does, so it
hides queueing; real traffic does not wait. These schedules are drawn up front from a seeded numpy
Generator, so two policies can be compared on the very same arrivals.

- ``poisson``: exponential gaps, coefficient of variation (CV) 1: independent users.
- ``gamma``: gamma-distributed gaps with shape k = 1/CV^2 and the same mean, so CV > 1 gives bursts
  (many near-zero gaps, then long silences) at the same average rate; CV 3-4 is what production LLM
  traces show and what stresses admission control.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, get_args

import numpy as np

ArrivalKind = Literal["poisson", "gamma"]
ARRIVAL_KINDS: tuple[str, ...] = get_args(ArrivalKind)
_CHUNK = 4096
GapSampler = Callable[[np.random.Generator, int], np.ndarray]


def gap_sampler(kind: str, rate_per_s: float, cv: float = 1.0) -> GapSampler:
    """A function (rng, n) -> n inter-arrival gaps in seconds with mean 1/rate_per_s."""
    if not (rate_per_s > 0 and np.isfinite(rate_per_s)):
        raise ValueError(f"rate_per_s must be a positive finite number, got {rate_per_s!r}")
    mean_gap = 1.0 / rate_per_s
    if kind == "poisson":
        return lambda rng, n: rng.exponential(mean_gap, size=n)
    if kind == "gamma":
        if not (cv > 0 and np.isfinite(cv)):
            raise ValueError(f"gamma arrivals need a positive finite cv, got {cv!r}")
        shape = 1.0 / (cv * cv)
        return lambda rng, n: rng.gamma(shape, mean_gap / shape, size=n)
    raise ValueError(f"unknown arrival kind {kind!r}; allowed: {', '.join(ARRIVAL_KINDS)}")


def arrival_times(
    kind: str,
    rate_per_s: float,
    *,
    duration_s: float | None = None,
    count: int | None = None,
    cv: float = 1.0,
    seed: int | np.random.SeedSequence = 0,
) -> np.ndarray:
    """Sorted arrival offsets in seconds from the start of the run (float64).

    Give exactly one of `duration_s` (every arrival before it; the count is random, as in reality) or
    `count` (exactly that many arrivals; the span is random). `cv` applies to ``gamma`` only; Poisson's
    CV is 1 by definition. The first arrival comes one gap after 0, so a schedule is a sum of gaps.
    """
    if (duration_s is None) == (count is None):
        raise ValueError("give exactly one of duration_s or count")
    sample = gap_sampler(kind, rate_per_s, cv)
    rng = np.random.default_rng(seed)
    if count is not None:
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        return np.cumsum(sample(rng, int(count)))
    assert duration_s is not None
    if not (duration_s >= 0 and np.isfinite(duration_s)):
        raise ValueError(f"duration_s must be a finite number >= 0, got {duration_s!r}")
    chunks: list[np.ndarray] = []
    last = 0.0
    while last < duration_s:
        times = last + np.cumsum(sample(rng, _CHUNK))
        chunks.append(times)
        last = float(times[-1])
    if not chunks:
        return np.empty(0, dtype=np.float64)
    times = np.concatenate(chunks)
    return times[times < duration_s]


def paced_arrival_times(
    kind: str,
    rate_per_s: float,
    duration_s: float,
    *,
    cv: float = 1.0,
    seed: int | np.random.SeedSequence = 0,
) -> np.ndarray:
    """Exactly round(rate x duration) arrivals in [0, duration_s), with the process's burst pattern.

    Over a short window a bursty process's count varies wildly (CV 3 over 6 s: from a third to twice the
    mean), so a sweep point would measure a different load than its label. Here the gaps are drawn as
    usual and scaled so that they span the window: the offered load is exact, the burstiness (the gaps'
    CV) is the process's.
    """
    if not (duration_s > 0 and np.isfinite(duration_s)):
        raise ValueError(f"duration_s must be a finite number > 0, got {duration_s!r}")
    count = round(rate_per_s * duration_s)
    gaps = gap_sampler(kind, rate_per_s, cv)(np.random.default_rng(seed), count + 1)
    return np.cumsum(gaps[:-1]) * (duration_s / float(gaps.sum()))


def gap_cv(times: np.ndarray) -> float:
    """Coefficient of variation (std / mean) of the gaps of a schedule: ~1 Poisson, >1 bursty."""
    gaps = np.diff(np.concatenate(([0.0], np.asarray(times, dtype=np.float64))))
    if gaps.size < 2 or gaps.mean() == 0:
        return float("nan")
    return float(gaps.std() / gaps.mean())
