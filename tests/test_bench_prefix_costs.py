"""bench.prefix_cache's cost plot (one panel per run that exists, each round's cost against bypass) and
its order of arms per round."""

from __future__ import annotations

from collections import Counter

from bench.prefix_cache import ThroughputRun, plot_costs, round_order


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


def test_every_arm_runs_in_every_position_and_after_every_other_arm_equally_often():
    orders = [round_order(index, 3) for index in range(6)]
    assert sorted(map(tuple, orders)) == sorted({tuple(o) for o in orders}) and len(orders) == 6
    positions = Counter((position, arm) for order in orders for position, arm in enumerate(order))
    assert set(positions.values()) == {2}
    pairs = Counter(pair for order in orders for pair in zip(order, order[1:]))
    assert len(pairs) == 6 and set(pairs.values()) == {2}, "each arm right after each other arm, twice"
    two = [round_order(index, 2) for index in range(4)]
    assert Counter(map(tuple, two)) == {(0, 1): 2, (1, 0): 2}
