"""A prompt whose normal form is empty (only a greeting, a preamble or punctuation: `normalize_question`
drops them all) reaches the embedder as "", so every such prompt has one vector, cosine 1.0 with every
other; the guard finds no words to compare, and the pair classifier (the default last check) reads two
contentless texts as one question. One such prompt's stored answer must not serve another's."""

from __future__ import annotations

import hashlib
import uuid

import numpy as np
import pytest

from cache.pair_classifier import CoalescingPairClassifier, PairClassifier
from cache.semantic_cache import PairCheck, SemanticResponseCache, normalize_question
from scheduler.messages import EngineRequestParams
from tests.conftest import answer

GREEDY = EngineRequestParams(max_tokens=32)


class TextHashEmbedder:
    """A deterministic stand-in for MiniLM: one unit vector per distinct text."""

    dim = 384

    def embed(self, texts):
        rows = []
        for text in texts:
            seed = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")
            v = np.random.default_rng(seed).standard_normal(self.dim).astype(np.float32)
            rows.append(v / np.linalg.norm(v))
        return np.stack(rows) if rows else np.zeros((0, self.dim), np.float32)

    def fits(self, texts):
        return [True] * len(texts)


@pytest.fixture(scope="module")
def pair_check():
    return PairCheck(CoalescingPairClassifier(PairClassifier.load()))


@pytest.mark.parametrize(
    "stored, asked",
    [("Hello?", "Please tell me..."), ("Hi!", "I want to know."), ("???", "!!!")],
)
def test_a_prompt_with_an_empty_normal_form_is_not_served_anothers_answer(
    redis_server,
    pair_check,
    stored,
    asked,  # noqa: F811
):
    assert normalize_question(stored) == normalize_question(asked) == ""
    cache = SemanticResponseCache(
        redis_server, f"fp-{uuid.uuid4().hex[:8]}", TextHashEmbedder(), pair_check=pair_check
    )
    try:
        cache.store(stored, "t1", GREEDY, answer(" the answer to the stored prompt"))
        hit = cache.lookup(asked, "t1", GREEDY)
        assert hit is None, f"{asked!r} was served {hit.prompt!r}'s answer (cosine {hit.score:.3f})"
    finally:
        cache.close()
