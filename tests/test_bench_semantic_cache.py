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


def test_out_of_fold_scores_every_tuning_query_once_with_a_verifier_fitted_without_it(monkeypatch):
    import bench.semantic_cache as bench

    pairs = [bench.Pair(f"a{i}", f"b{i}", i % 3 != 0, "paraphrase", "original") for i in range(40)]
    tuning = [i % 4 != 0 for i in range(40)]
    fitted_without: dict[int, set[int]] = {}

    def fit_on(fold):
        fitted_without[fold] = {i for i, p in enumerate(pairs) if p.bucket % bench.FOLDS == fold}
        return fold

    def fake_grid(pairs_, ranked, verifier, keep, highs, lows, cuts, checks):
        scored = [i for i, k in enumerate(keep) if k]
        assert set(scored) <= fitted_without[verifier]  # only queries the verifier was fitted without
        return [
            bench.score(pairs_, [(p.a, "high") if p.same else None for p in pairs_], keep, hi, hi, True)
            for hi in highs
        ]

    monkeypatch.setattr(bench, "grid_points", fake_grid)
    points = bench.out_of_fold_points(pairs, None, fit_on, tuning, [0.8, 0.9], [], [], [None])
    assert sorted(fitted_without) == list(range(bench.FOLDS))
    assert [p.threshold for p in points] == [0.8, 0.9]
    for p in points:  # every tuning query counted exactly once across the folds
        assert p.true_pairs == sum(pr.same for pr, t in zip(pairs, tuning) if t)
        assert p.hits == p.correct_hits == p.correct_on_true == p.true_pairs


def test_pooled_sums_a_settings_points():
    from bench.semantic_cache import Point, pooled

    a = Point(0.8, 0.9, 0.6, True, 10, 9, 4, 1, 12, 9, {"topic": 1}, 0.3, None)
    b = Point(0.8, 0.9, 0.6, True, 5, 4, 2, 0, 7, 4, {"topic": 1, "reversal": 0}, 0.3, None)
    p = pooled([a, b])
    assert (p.hits, p.correct_hits, p.low_band_hits, p.low_band_wrong, p.true_pairs, p.correct_on_true) == (
        15, 13, 6, 1, 19, 13,
    )  # fmt: skip
    assert p.wrong_by_kind == {"topic": 2, "reversal": 0} and (p.threshold, p.pair_min) == (0.8, 0.3)
