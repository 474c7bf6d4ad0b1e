"""bench.lookup_offload, small: the real engine and semantic cache against a real redis-server; with the
lookups on their own threads the burst's submits return without waiting for them, every mode's
requests all finish, and the coalesced modes' lookups go through the coalescing embedder."""

from __future__ import annotations

import json

from bench.lookup_offload import MODES, main


def test_the_burst_submits_return_at_once_with_the_lookups_off_the_submitting_thread(tmp_path):
    assert main(["--rounds", "1", "--burst", "3", "--out-dir", str(tmp_path), "--tag", "t"]) == 0
    data = json.loads((tmp_path / "lookup-offload-t.json").read_text())
    results = {r["mode"]: r for r in data["results"]}
    assert set(results) == {name for name, _, _ in MODES} >= {"inline", "2 threads", "8 threads, coalesced"}
    inline, pooled = results["inline"], results["2 threads"]
    assert pooled["submit_ms"][0] < inline["submit_ms"][0] / 3, "inline submits wait for three lookups"
    assert all(len(r["sampled_ttft_ms"]) == 1 and r["last_greedy_ttft_ms"][0] > 0 for r in results.values())
    assert all(r["hits"] == 0 for r in results.values()), "every greedy request is a miss, in every mode"
    for r in results.values():  # the coalesced modes count their MiniLM passes: every lookup embedded once
        assert (r["embed_texts"] >= 3 and 0 < r["embed_passes"] <= r["embed_texts"]) == r["coalesced"], r
    assert (tmp_path / "lookup-offload-t.png").stat().st_size > 0
