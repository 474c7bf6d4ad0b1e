"""bench.semantic_cache's fresh pairs are measured only: whichever fresh set is given, the thresholds
and the verifier chosen on the tuning half are the same, and the fresh set is reported on its own
(its entries in a tenant of their own, so they never compete with the main set's)."""

from __future__ import annotations

import json

from bench.semantic_cache import DATA, FRESH, main

MAIN_PAIRS = 160  # enough of the original pairs for a grid point to reach the precision floor


def run(tmp_path, fresh_lines: list[str], name: str) -> dict:
    data, fresh = tmp_path / "pairs.jsonl", tmp_path / f"{name}.jsonl"
    data.write_text("\n".join(DATA.read_text().splitlines()[:MAIN_PAIRS]) + "\n")
    fresh.write_text("\n".join(fresh_lines) + "\n")
    out = tmp_path / name
    assert main(["--data", str(data), "--fresh", str(fresh), "--results-dir", str(out), "--tag", "t"]) == 0
    return json.loads((out / "semantic-cache-t.json").read_text())["summary"]


def test_fresh_pairs_are_measured_but_never_tuned_on(tmp_path):
    lines = FRESH.read_text().splitlines()
    first, second = run(tmp_path, lines[:30], "first"), run(tmp_path, lines[30:70], "second")
    for rule, chosen in first["choices"].items():
        same = {k: v for k, v in chosen.items() if not k.endswith("(never tuned on)")}
        assert same == {k: v for k, v in second["choices"][rule].items() if k in same}, rule
    assert first["verifier_tuning_half"] == second["verifier_tuning_half"]
    assert first["halves"] == second["halves"] and sum(first["halves"].values()) == MAIN_PAIRS
    for summary, chunk, name in ((first, lines[:30], "first"), (second, lines[30:70], "second")):
        fresh = summary["fresh_at_headline"][name]
        assert fresh is not None, "the headline setting is reported on the fresh pairs"
        assert fresh["true_pairs"] == sum(json.loads(line)["same"] for line in chunk)
        assert summary["sources"][name] == len(chunk)
        assert summary["stored_entries_fresh"] == len({json.loads(line)["a"] for line in chunk})
