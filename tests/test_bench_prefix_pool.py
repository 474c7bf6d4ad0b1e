"""bench.prefix_cache_pool: rounds of several saved runs pooled per mode and comparison."""

from __future__ import annotations

import json

import pytest

from bench.prefix_cache_pool import CONTROL, main, median_interval, pooled_costs


def saved_run(use: float, loaded: bool, machine: str = "vm (x86_64, NVIDIA H200)") -> dict:
    """A run whose `use` arm is `use` req/s against a bypass of 100 in each of its 4 rounds."""
    part = {"rounds": [{"use": use, "kv-only": 100.0, "bypass": 100.0}] * 4, "control": [[99.0, 100.0]] * 2}
    return {"machine": machine, "date": "d", "command": "c", "throughput": part,
            "throughput_concurrent": part if loaded else None}  # fmt: skip


def test_rounds_of_every_run_are_pooled_per_mode_and_a_mode_no_run_measured_is_left_out():
    pooled = pooled_costs([saved_run(99.0, loaded=False), saved_run(98.0, loaded=False)])
    assert {p.mode for p in pooled} == {"one at a time"}
    use = next(p for p in pooled if p.comparison.startswith("all caches"))
    assert use.runs == 2 and sorted(use.costs) == pytest.approx([0.01] * 4 + [0.02] * 4)
    control = next(p for p in pooled if p.comparison == CONTROL)
    assert control.costs == pytest.approx([0.01] * 4)


def test_the_medians_interval_holds_the_median_and_narrows_with_more_rounds():
    few = [0.01 * (i % 5) for i in range(10)]
    low, high = median_interval(few)
    assert low <= 0.02 <= high and high - low > 0
    many_low, many_high = median_interval(few * 20)
    assert many_high - many_low <= high - low
    assert median_interval(few) == (low, high), "a fixed seed: the same rounds give the same report"


def test_the_report_is_written_and_runs_of_different_machines_are_refused(tmp_path):
    paths = []
    for i, machine in enumerate(["gpu box", "gpu box", "cpu box"]):
        paths.append(tmp_path / f"run{i}.json")
        paths[-1].write_text(json.dumps(saved_run(99.0 - i / 2, loaded=True, machine=machine)))  # 3 runs
    assert main([str(p) for p in paths[:2]] + ["--tag", "t", "--out-dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "prefix-cache-pooled-t.json").read_text())
    assert report["machine"] == "gpu box" and len(report["pooled"]) == 6
    assert "under load" in (tmp_path / "prefix-cache-pooled-t.md").read_text()
    with pytest.raises(SystemExit):
        main([str(p) for p in paths] + ["--tag", "t", "--out-dir", str(tmp_path)])
