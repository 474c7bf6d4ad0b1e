"""Warmup planning from traffic: percentile buckets, fallbacks, KV reserve prediction."""

import pytest

from scheduler.warmup_planner import percentile_length, plan_buckets, predict_reserve

DEFAULTS = (16, 32, 64, 128, 256, 512, 1024)


def test_percentile_length_is_nearest_rank():
    histogram = {10: 50, 20: 40, 300: 9, 1000: 1}
    assert percentile_length(histogram, 50) == 10
    assert percentile_length(histogram, 90) == 20
    assert percentile_length(histogram, 99) == 300
    assert percentile_length(histogram, 100) == 1000
    with pytest.raises(ValueError):
        percentile_length({}, 50)


def test_buckets_are_cut_at_traffic_percentiles_and_end_at_the_limit():
    histogram = {40: 500, 100: 400, 150: 50, 600: 40, 1500: 10}
    plan = plan_buckets(histogram, 2048, DEFAULTS)
    assert plan.source == "traffic" and plan.samples == 1000
    assert plan.cuts == {"p50": 40, "p90": 100, "p95": 150, "p99": 600, "p100": 1500}
    for cut in plan.cuts.values():  # every percentile length has a bucket aligned just above it
        assert -(-cut // 16) * 16 in plan.buckets
    assert plan.buckets[-1] == 2048
    assert all(b2 <= 2 * b1 for b1, b2 in zip(plan.buckets, plan.buckets[1:])), plan.buckets
    assert list(plan.buckets) == sorted(set(plan.buckets))


def test_every_recorded_length_fits_a_bucket():
    histogram = {n: 1 for n in range(1, 2049, 37)}
    plan = plan_buckets(histogram, 2048, DEFAULTS)
    assert all(any(b >= n for b in plan.buckets) for n in histogram)


def test_without_enough_history_the_defaults_are_used():
    assert plan_buckets(None, 2048, DEFAULTS).buckets == (*DEFAULTS, 2048)
    few = plan_buckets({100: 10}, 2048, DEFAULTS, min_samples=50)
    assert few.source == "default" and few.samples == 10
    assert plan_buckets({}, 512, DEFAULTS).buckets == (16, 32, 64, 128, 256, 512)


def test_lengths_beyond_the_limit_are_ignored():
    plan = plan_buckets({100: 60, 9999: 1000}, 2048, DEFAULTS)
    assert plan.samples == 60 and plan.buckets[-1] == 2048


def test_reserve_prediction_weights_recent_peaks_more():
    now = 100_000.0
    old_spike = [(now - 4 * 3600, 16.0), (now - 60, 4.0)]
    # the 16 from four half-lives ago weighs 1, the fresh 4 weighs ~4: the fresh peak wins
    assert predict_reserve(old_spike, now, half_life_s=3600, headroom=1.0) == pytest.approx(
        4 * 0.5 ** (60 / 3600)
    )
    recent_spike = [(now - 3600, 16.0), (now - 60, 4.0)]
    assert predict_reserve(recent_spike, now, half_life_s=3600, headroom=1.5) == pytest.approx(12.0)
    assert predict_reserve([], now, 3600, 1.5) == 0.0


def test_no_bucket_is_longer_than_the_sequence_limit_even_below_the_alignment():
    plan = plan_buckets({5: 100}, max_len=8, defaults=())
    assert max(plan.buckets) == 8, plan.buckets


def test_an_empty_histogram_falls_back_to_the_defaults_even_with_min_samples_zero():
    plan = plan_buckets({}, max_len=64, defaults=(16, 32), min_samples=0)
    assert plan.buckets == (16, 32, 64) and plan.source == "default"
