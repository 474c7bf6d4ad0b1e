"""Arrival schedules: mean rate, burstiness (gap CV) and reproducibility from the seed."""

from __future__ import annotations

import numpy as np
import pytest

from client.arrivals import arrival_times, gap_cv, paced_arrival_times


@pytest.mark.parametrize(("kind", "cv"), [("poisson", 1.0), ("gamma", 3.0), ("gamma", 4.0)])
def test_mean_rate_and_gap_cv(kind: str, cv: float) -> None:
    times = arrival_times(kind, 20.0, count=200_000, cv=cv, seed=7)
    gaps = np.diff(np.concatenate(([0.0], times)))
    assert times.size == 200_000 and np.all(gaps >= 0)
    assert 1.0 / gaps.mean() == pytest.approx(20.0, rel=0.03)
    assert gap_cv(times) == pytest.approx(cv, rel=0.06)


def test_poisson_cv_ignores_the_cv_argument() -> None:
    assert gap_cv(arrival_times("poisson", 5.0, count=100_000, cv=4.0, seed=1)) == pytest.approx(
        1.0, rel=0.03
    )


@pytest.mark.parametrize("kind", ["poisson", "gamma"])
def test_duration_bounds_the_schedule_and_rate_holds(kind: str) -> None:
    times = arrival_times(kind, 50.0, duration_s=2000.0, cv=3.0, seed=3)
    assert np.all(np.diff(times) >= 0) and times[0] > 0 and times[-1] < 2000.0
    assert times.size / 2000.0 == pytest.approx(50.0, rel=0.05)


def test_gamma_is_bursty_many_tiny_gaps() -> None:
    """Same mean rate, but CV 4 puts most arrivals in bursts: the median gap is far below the mean."""
    gaps = np.diff(arrival_times("gamma", 10.0, count=50_000, cv=4.0, seed=2))
    assert np.median(gaps) < 0.01 * gaps.mean()


def test_seed_reproduces_and_differs() -> None:
    a = arrival_times("gamma", 5.0, duration_s=60.0, cv=3.0, seed=11)
    b = arrival_times("gamma", 5.0, duration_s=60.0, cv=3.0, seed=11)
    c = arrival_times("gamma", 5.0, duration_s=60.0, cv=3.0, seed=12)
    np.testing.assert_array_equal(a, b)
    assert a.size != c.size or not np.array_equal(a, c)


def test_zero_duration_and_zero_count() -> None:
    assert arrival_times("poisson", 5.0, duration_s=0.0).size == 0
    assert arrival_times("poisson", 5.0, count=0).size == 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"kind": "uniform", "rate_per_s": 1.0, "count": 3},
            "unknown arrival kind 'uniform'; allowed: poisson, gamma",
        ),
        ({"kind": "poisson", "rate_per_s": 0.0, "count": 3}, "rate_per_s must be a positive"),
        ({"kind": "gamma", "rate_per_s": 1.0, "count": 3, "cv": 0.0}, "positive finite cv"),
        ({"kind": "poisson", "rate_per_s": 1.0}, "exactly one of duration_s or count"),
        ({"kind": "poisson", "rate_per_s": 1.0, "count": 3, "duration_s": 1.0}, "exactly one"),
        ({"kind": "poisson", "rate_per_s": 1.0, "count": -1}, "count must be >= 0"),
    ],
)
def test_bad_arguments_say_what_is_allowed(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        arrival_times(**kwargs)


def test_paced_arrivals_offer_the_exact_load_and_stay_bursty() -> None:
    counts = [len(paced_arrival_times("gamma", 7.0, 6.0, cv=3.0, seed=s)) for s in range(20)]
    assert set(counts) == {42}
    times = paced_arrival_times("gamma", 50.0, 100.0, cv=3.0, seed=1)
    assert 0 <= times[0] and times[-1] < 100.0 and np.all(np.diff(times) >= 0)
    assert gap_cv(times) > 2.0
    assert np.array_equal(times, paced_arrival_times("gamma", 50.0, 100.0, cv=3.0, seed=1))
    with pytest.raises(ValueError, match="duration_s"):
        paced_arrival_times("gamma", 1.0, 0.0)
