"""bench.prefix_cache's cost plot: one panel per run that exists, each round's cost against bypass."""

from __future__ import annotations

from bench.prefix_cache import ThroughputRun, plot_costs


def run(rounds: int) -> ThroughputRun:
    rates = [{"use": 99.0 + i % 2, "kv-only": 99.5, "bypass": 100.0} for i in range(rounds)]
    return ThroughputRun(rates, [(100.0, 100.5)] * 3, {}, 0)


def test_the_cost_plot_draws_a_panel_per_run_and_skips_a_missing_one(tmp_path):
    both, alone = tmp_path / "both.png", tmp_path / "alone.png"
    plot_costs([("one at a time", run(4)), ("concurrency 8", run(6))], both)
    plot_costs([("one at a time", run(4)), ("concurrency 8", None)], alone)
    for path in (both, alone):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    width = int.from_bytes(both.read_bytes()[16:20], "big")
    assert width > int.from_bytes(alone.read_bytes()[16:20], "big"), "two panels are wider than one"
