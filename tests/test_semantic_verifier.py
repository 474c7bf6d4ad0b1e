"""The semantic cache's lower-band verifier: weights file, features, decision, and its place in lookup."""

from __future__ import annotations

import json
import uuid

import numpy as np
import pytest

from cache.semantic_cache import SemanticResponseCache, content_words, normalize_question
from cache.semantic_verifier import DEFAULT_WEIGHTS, FEATURES, Verifier, fit, pair_features, question_word
from scheduler.messages import EngineRequestParams
from tests.conftest import answer

GREEDY = EngineRequestParams(max_tokens=32)


def feats(query: str, entry: str, cosine: float, margin: float) -> np.ndarray:
    return pair_features(
        cosine,
        margin,
        content_words(query),
        content_words(entry),
        normalize_question(query),
        normalize_question(entry),
    )


def test_shipped_weights_load_and_are_the_current_version():
    v = Verifier.load(DEFAULT_WEIGHTS)
    assert v.features == FEATURES and 0 < v.p_min < 1 and 0.5 <= v.low_threshold < 0.8
    assert "tuning half" in v.fitted_on  # never fitted on the held-out half


@pytest.mark.parametrize(
    "change, message",
    [
        ({"version": 99}, "v1"),
        ({"format": "pickle"}, "not a"),
        ({"features": ["cosine", "margin", "overlap", "same_question_word", "other"]}, "features"),
        ({"weights": [1.0, 2.0]}, "match"),
        ({"scale": [0.0, 1, 1, 1, 1]}, "positive"),
    ],
)
def test_a_wrong_weights_file_is_refused(tmp_path, change, message):
    body = {**json.loads(DEFAULT_WEIGHTS.read_text()), **change}
    path = tmp_path / "w.json"
    path.write_text(json.dumps(body))
    with pytest.raises(ValueError, match=message):
        Verifier.load(path)


def test_cache_without_loadable_weights_closes_the_band(tmp_path, monkeypatch, redis_server):
    import cache.semantic_cache as sc

    bad = tmp_path / "w.json"
    bad.write_text(json.dumps({**json.loads(DEFAULT_WEIGHTS.read_text()), "version": 0}))
    monkeypatch.setattr(sc, "DEFAULT_WEIGHTS", bad)
    c = SemanticResponseCache(redis_server, "fp", embedder=None, threshold=0.8)
    assert c.verifier is None and c.low_threshold == 0.8
    c.close()
    ok = SemanticResponseCache(redis_server, "fp", embedder=None, threshold=0.8, verifier=Verifier.load())
    assert ok.low_threshold == ok.verifier.low_threshold < 0.8
    ok.close()


def test_shipped_verifier_accepts_a_distinct_rewording_and_rejects_a_near_miss():
    v = Verifier.load()
    # a reworded question, far ahead of any other stored question
    para = feats(
        "How can I stop receiving promotional emails?",
        "How do I unsubscribe from marketing emails?",
        0.75,
        0.3,
    )
    assert v.accepts(para)
    # the same object, another action, with another stored question just as close: a near miss
    near = feats("How do I pause my subscription?", "How do I cancel my subscription?", 0.72, 0.01)
    assert not v.accepts(near)
    assert v.probability(near) < v.probability(para)


def test_fit_learns_a_separable_rule_and_round_trips(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 1, size=(200, len(FEATURES)))
    y = (x[:, 1] > 0.5).astype(float)  # only the margin decides
    v = fit(x, y, l2=0.1, p_min=0.5, low_threshold=0.6, fitted_on="synthetic")
    assert np.argmax(np.abs(v.weights)) == 1 and v.weights[1] > 0
    acc = np.mean([v.accepts(row) == bool(label) for row, label in zip(x, y)])
    assert acc > 0.95
    v.save(tmp_path / "v.json")
    again = Verifier.load(tmp_path / "v.json")
    assert again.p_min == 0.5 and abs(again.probability(x[0]) - v.probability(x[0])) < 1e-6
    with pytest.raises(ValueError):
        fit(x[:, :3], y)


def test_question_word_classes():
    assert question_word("why is my bill higher") == "why"
    assert question_word("how much does it cost") == "quantity"
    assert question_word("how do i reset it") == "how"
    assert question_word("is it safe") == "yes-no"


class OneHotEmbedder:
    """Embeddings chosen by the test: a text's vector is looked up, so cosines are exact."""

    def __init__(self, table: dict[str, np.ndarray]):
        self.table = {normalize_question(k): v for k, v in table.items()}

    def embed(self, texts):
        return np.stack([self.table[t] for t in texts]).astype(np.float32)

    def fits(self, texts):
        return [True] * len(texts)


def unit(*xs: float) -> np.ndarray:
    v = np.zeros(384, np.float32)
    v[: len(xs)] = xs
    return v / np.linalg.norm(v)


def test_lookup_uses_the_verifier_only_in_the_band_and_after_the_guard(redis_server):
    stored = "How do I unsubscribe from marketing emails?"
    para = "How can I stop receiving promotional emails?"
    negated = "How do I not unsubscribe from marketing emails?"
    emb = OneHotEmbedder({stored: unit(1, 0), para: unit(0.72, 0.694), negated: unit(0.72, 0.694)})
    accept_all = Verifier(
        mean=(0.0,) * 5,
        scale=(1.0,) * 5,
        weights=(0.0,) * 5,
        bias=10.0,
        p_min=0.5,
        low_threshold=0.6,
        min_entries=1,
    )
    c = SemanticResponseCache(
        redis_server, f"fp-{uuid.uuid4().hex[:8]}", emb, threshold=0.8, verifier=accept_all
    )
    try:
        assert c.store(stored, "t", GREEDY, answer(" Click unsubscribe."))
        hit = c.lookup(para, "t", GREEDY)
        assert hit is not None and hit.band == "verified" and 0.7 < hit.score < 0.8
        assert c.lookup(negated, "t", GREEDY) is None  # the guard runs first, whatever the verifier says
        assert c.lookup(para, "other-tenant", GREEDY) is None  # tenants stay apart
        reject_all = Verifier(**{**accept_all.__dict__, "bias": -10.0})
        c.verifier = reject_all
        assert c.lookup(para, "t", GREEDY) is None
        assert c.snapshot()["verifier_rejections"] == 1
        c.verifier = Verifier(**{**accept_all.__dict__, "min_entries": 2})  # too few entries: band closed
        assert c.lookup(para, "t", GREEDY) is None
        assert c.lookup(para, "t", GREEDY, low_threshold=0.8) is None
    finally:
        c.close()
