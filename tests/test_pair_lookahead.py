"""The pair check's look-ahead (a lookup's next candidate scored in the same pass) and the shared
classifier decide exactly as the classifier alone, one candidate at a time, did (found by a review)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")

from cache.pair_classifier import CoalescingPairClassifier
from cache.semantic_cache import Candidate, PairCheck, _Query, _TenantMatrix, select

QUERY = "How do I transfer photos from my phone to my laptop?"
SAME = "how do I  transfer photos from my phone to my LAPTOP?"  # the query up to case and spacing
OTHER = "How can I move pictures from my phone onto my laptop?"  # a guard-ok paraphrase


def candidates(query: str, rows: list[tuple[str, float]]) -> list[Candidate]:
    n = len(rows)
    tm = _TenantMatrix(
        None, [f"id{i}" for i in range(n)], [p for p, _ in rows], ["a"] * n, ["s"] * n,
        np.zeros(n), np.zeros((n, 2), np.float32),
    )  # fmt: skip
    q = _Query(query)
    return [Candidate(i, s, s - rows[1][1] if i == 0 else 0.0, q, tm) for i, (_, s) in enumerate(rows)]


class Recorder:
    def __init__(self, fail=False, value=0.9):
        self.passes, self.fail, self.value = [], fail, value

    def probability(self, pairs):
        self.passes.append(list(pairs))
        if self.fail:
            raise RuntimeError("model down")
        return np.full(len(pairs), self.value)


def counted():
    seen: dict[str, int] = {}

    def count(name, n=1):
        seen[name] = seen.get(name, 0) + n

    return seen, count


def test_a_text_identical_best_candidate_needs_no_model_pass():
    """The same text up to case and spacing is 1.0 without the model: a hit with no pass, and no pass run
    for the next candidate either."""
    model = Recorder()
    chosen = select(candidates(QUERY, [(SAME, 0.99), (OTHER, 0.95)]), 0.8, 0.6, None, 2,
                    pair_check=PairCheck(model, 0.3, max_scored=2))  # fmt: skip
    assert chosen is not None and chosen[0].prompt == SAME
    assert model.passes == [], f"a model pass for a lookup that needs none: {model.passes}"


def test_a_failing_model_does_not_turn_a_text_identical_hit_into_a_miss():
    """A model that is down cannot turn such a hit into a miss through the next candidate's pass."""
    seen, count = counted()
    chosen = select(candidates(QUERY, [(SAME, 0.99), (OTHER, 0.95)]), 0.8, 0.6, None, 2, count=count,
                    pair_check=PairCheck(Recorder(fail=True), 0.3, max_scored=2))  # fmt: skip
    assert chosen is not None and chosen[0].prompt == SAME, f"miss; counters {seen}"
    assert seen.get("pair_errors", 0) == 0


def test_the_shared_classifier_decides_as_the_classifier_does_at_the_default_cut():
    """PairClassifier.probability is the mean of two float32 sigmoids, computed in float64: it can be a
    float32 midpoint. Rows rounded to float32 would turn the midpoint of 0.3's float32 neighbours (just
    under 0.3) into float32(0.3) > 0.3, and serve a candidate the plain classifier turns down."""
    above, below = np.float32(0.3), np.nextafter(np.float32(0.3), np.float32(0))  # float32 neighbours of 0.3
    p = (float(below) + float(above)) / 2  # what PairClassifier.probability returns for these two orders
    assert p < 0.3

    class Fixed:
        def probability(self, pairs):
            return np.full(len(pairs), p)

    rows = [(OTHER, 0.95), ("How do I cook rice?", 0.1)]
    plain = select(candidates(QUERY, rows), 0.8, 0.6, None, 1, pair_check=PairCheck(Fixed(), 0.3))
    shared = select(candidates(QUERY, rows), 0.8, 0.6, None, 1,
                    pair_check=PairCheck(CoalescingPairClassifier(Fixed()), 0.3))  # fmt: skip
    assert plain is None
    assert shared is None, "served through CoalescingPairClassifier, turned down by the same classifier"
