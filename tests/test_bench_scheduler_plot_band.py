"""bench/scheduler.py plot(): the per-seed band skips a seed without critical requests (NaN), as _seed_range
does (found in review, 2026-12-07)."""

import math

import matplotlib.axes

import bench.scheduler as sched


def _run(rate, by_seed):
    stats = sched.TierStats(10, 10, 0.5, 1.0, 2.0, 3.0, 4.0, 1.0, 0, 0, 0)
    return sched.RunResult(
        policy="fifo",
        engine_policy="fifo",
        admission=False,
        rate=rate,
        seeds=sorted(by_seed),
        planned=10,
        measured=10,
        window_s=1.0,
        tiers={"critical": stats},
        critical_attainment_by_seed=by_seed,
        tpot_p95_ms=1.0,
        batch_throughput_rps=1.0,
        batch_tokens_per_s=1.0,
        rejected=0,
        timeouts=0,
        errors=0,
        max_send_lag_ms=0.0,
        wall_s=0.0,
        engine_adaptations=0.0,
    )


def test_band_ignores_nan_seed_regardless_of_seed_order(monkeypatch, tmp_path):
    bands = []
    monkeypatch.setattr(
        matplotlib.axes.Axes,
        "fill_between",
        lambda self, x, low, high, **kw: bands.append((list(low), list(high))),
    )
    # seed 1 had no critical request at this rate (NaN, as scheduler-h200.json at 1.3 req/s), seed 2 met 50%
    runs = [_run(1.0, {1: float("nan"), 2: 0.5}), _run(2.0, {1: 0.9, 2: 0.7})]
    sched.plot({"fifo": runs}, None, 120.0, tmp_path / "p.png")
    ((low, high),) = bands
    assert not any(math.isnan(v) for v in low + high), (low, high)
    assert low == [50.0, 70.0] and high[0] == 50.0
