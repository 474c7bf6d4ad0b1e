"""bench.store_cost on the tiny model: every scenario measured, and the store's evictions as the pool
arithmetic says (a new prompt of 15 full blocks in a full L1 evicts 15 rows)."""

from __future__ import annotations

import json

from bench.store_cost import main


def test_store_cost_reports_each_scenario_with_its_evictions(tmp_path):
    assert main(["--stores", "30", "--out-dir", str(tmp_path), "--tag", "t"]) == 0
    data = json.loads((tmp_path / "store-cost-t.json").read_text())
    results = {r["scenario"]: r for r in data["results"]}
    slept = "L1 full, L2, after 20 ms of host sleep"
    assert set(results) == {"L1 with free rows", "L1 full, demoting to L2", "L1 full, no L2", slept}
    assert results["L1 with free rows"]["evictions_per_store"] == 0
    assert results["L1 full, demoting to L2"]["evictions_per_store"] == 15
    assert results["L1 full, no L2"]["evictions_per_store"] == 15
    assert results[slept]["evictions_per_store"] == 15
    assert all(len(r["seconds"]) > 0 and min(r["seconds"]) > 0 for r in results.values())
    assert (tmp_path / "store-cost-t.png").stat().st_size > 0
    assert "python -m bench.store_cost" in (tmp_path / "store-cost-t.md").read_text()
