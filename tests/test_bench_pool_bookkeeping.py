"""bench.prefix_cache_pool: what may be pooled. Found in review: the pool checks the machine and the
turn size, but not the number of clients, so a run at capacity (16 clients) pools silently with runs
under load (8 clients), both 96 requests a turn; and the same run given twice is counted twice."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from bench.prefix_cache_pool import main

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"


def saved(concurrency: int, use: float = 99.0) -> dict:
    rounds = [{"use": use, "kv-only": 99.0, "bypass": 100.0}] * 4
    loaded = {
        "concurrency": concurrency,
        "requests_per_turn": 96,
        "rounds": rounds,
        "control": [[99.0, 100.0]] * 2,
    }
    single = {"rounds": rounds, "control": [[99.0, 100.0]]}
    return {
        "machine": "m",
        "date": "d",
        "command": "c",
        "throughput": single,
        "throughput_concurrent": loaded,
    }


def test_runs_with_different_client_counts_are_refused(tmp_path):
    paths = []
    for i, concurrency in enumerate((8, 16)):
        paths.append(tmp_path / f"r{i}.json")
        paths[-1].write_text(json.dumps(saved(concurrency)))
    with pytest.raises(SystemExit):
        main([str(p) for p in paths] + ["--tag", "t", "--out-dir", str(tmp_path)])


def test_committed_capacity_and_load_runs_are_not_pooled(tmp_path):
    files = [
        RESULTS / "prefix-cache-capacity-h200-0544.json",
        RESULTS / "prefix-cache-throughput-h200-0533.json",
    ]
    with pytest.raises(SystemExit):
        main([str(p) for p in files] + ["--tag", "t", "--out-dir", str(tmp_path)])


def test_the_same_run_given_twice_is_refused(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(saved(8)))
    copy = tmp_path / "copy.json"
    shutil.copy(path, copy)
    with pytest.raises(SystemExit):
        main([str(path), str(path), "--tag", "t", "--out-dir", str(tmp_path)])
    with pytest.raises(SystemExit):  # the same rounds under another name
        main([str(path), str(copy), "--tag", "t", "--out-dir", str(tmp_path)])


def test_distinct_runs_of_one_design_still_pool(tmp_path):
    paths = []
    for i, use in enumerate((99.0, 98.0)):
        paths.append(tmp_path / f"r{i}.json")
        paths[-1].write_text(json.dumps(saved(8, use)))
    assert main([str(p) for p in paths] + ["--tag", "t", "--out-dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "prefix-cache-pooled-t.json").read_text())
    loaded = [p for p in report["pooled"] if p["mode"] == "under load" and p["comparison"].startswith("all")]
    assert len(loaded[0]["costs"]) == 8
