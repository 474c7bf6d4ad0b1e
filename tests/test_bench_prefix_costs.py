"""bench.prefix_cache's cost plot (one panel per run that exists, each round's cost against bypass) and
its order of arms per round, the P25-P75 of its rounds, store_cost's P90 and the pool's input check."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from bench.prefix_cache import ThroughputRun, cost_row, plot_costs, round_order
from bench.store_cost import StoreTimes


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


def interval(row) -> tuple[float, float]:
    low, high = row[5].split(" to ")
    return float(low.rstrip("%")), float(high.rstrip("%"))


@pytest.mark.parametrize("n", [2, 4, 40])  # 2: the A/A rounds one at a time, 4: the rounds, 40: the default
def test_cost_row_p25_p75_are_numpys_not_a_handful_of_rounds_maximum(n):
    """Found in review (2026-12-07): the sorted losses indexed at n // 4 and 3n // 4 read the largest of 4
    rounds as their P75, and 2 rounds as smallest to largest."""
    costs = [i * 0.01 for i in range(n)]  # 0%, 1%, 2%, ...
    low, high = interval(cost_row("x", [(1.0 - c, 1.0) for c in costs]))
    p25, p75 = np.percentile(np.array(costs) * 100, [25, 75])
    assert (low, high) == (pytest.approx(p25, abs=0.051), pytest.approx(p75, abs=0.051))
    assert high < max(costs) * 100


def test_four_rounds_run_use_before_bypass_as_often_as_after():
    """Every committed one-at-a-time GPU run has 4 rounds; the old order ran `use` first in 1 of them."""
    orders = [round_order(i, 3) for i in range(4)]
    assert sum(o.index(0) < o.index(2) for o in orders) == 2
    assert sum(o.index(1) < o.index(2) for o in orders) == 2


def test_store_cost_p90_of_ten_stores_is_not_the_slowest_store():
    times = StoreTimes("s", [i / 1000 for i in range(1, 11)], 0.0)  # 1..10 ms
    assert float(times.row[3]) == pytest.approx(float(np.percentile(np.arange(1, 11), 90)), abs=0.001)


def test_the_pool_refuses_runs_whose_turns_differ_in_size(tmp_path):
    from bench.prefix_cache_pool import main

    def saved(per_turn: int) -> dict:
        rounds = [{"use": 99.0, "kv-only": 99.0, "bypass": 100.0}] * 4
        part = {"requests_per_turn": per_turn, "rounds": rounds, "control": [[99.0, 100.0]] * 2}
        return {
            "machine": "m",
            "date": "d",
            "command": "c",
            "throughput": part,
            "throughput_concurrent": None,
        }

    paths = []
    for per_turn in (10, 40):
        paths.append(tmp_path / f"r{per_turn}.json")
        paths[-1].write_text(json.dumps(saved(per_turn)))
    with pytest.raises(SystemExit):
        main([str(p) for p in paths] + ["--tag", "t", "--out-dir", str(tmp_path)])
    same = tmp_path / "r10-again.json"
    same.write_text(json.dumps(saved(10) | {"date": "another run"}))
    same.write_text(same.read_text().replace("99.0", "98.0"))
    assert main([str(paths[0]), str(same), "--tag", "t", "--out-dir", str(tmp_path)]) == 0
