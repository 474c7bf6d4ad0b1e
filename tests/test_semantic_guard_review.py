"""The semantic guard on text that reads alike but is written otherwise, and the lookup's faults (found in
review, 2026-12-07): apostrophes other than "'", Unicode letters, accents, emoji, numbers as fractions,
superscripts and words, the opener rule, a store whose embedding raises, an overruled candidate's cut."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from cache.embed_coalescer import CoalescingEmbedder
from cache.semantic_cache import Candidate, PairCheck, SemanticResponseCache, _Query, _TenantMatrix, select
from scheduler.messages import EngineRequestParams
from tests.conftest import answer
from tests.test_semantic_verifier import OneHotEmbedder, unit

GREEDY = EngineRequestParams(max_tokens=32)


def make_cache(redis_server, table):
    return SemanticResponseCache(
        redis_server, f"fp-{uuid.uuid4().hex[:8]}", OneHotEmbedder(table), threshold=0.82, verifier=None
    )


def served(redis_server, stored: str, query: str, cosine: float = 0.9):
    """Whether `query` is served `stored`'s answer when their embeddings are at `cosine` (1.0: the
    normalised texts are the same, one vector)."""
    table = {stored: unit(1, 0)}
    if query not in table and cosine < 1.0:
        table[query] = unit(cosine, float(np.sqrt(1 - cosine**2)))
    c = make_cache(redis_server, table)
    try:
        assert c.store(stored, "t", GREEDY, answer("stored answer"))
        return c.lookup(query, "t", GREEDY) is not None
    finally:
        c.close()


# --- 1. negation written with an apostrophe the normaliser knows but the guard's tokens do not ---------


def test_control_ascii_apostrophe_negation_is_refused(redis_server):
    assert not served(redis_server, "Why does my card work abroad?", "Why doesn't my card work abroad?")


@pytest.mark.parametrize("apostrophe", ["`", "\u2018", "\uff07"], ids=["backtick", "left-quote", "fullwidth"])
def test_negation_with_another_apostrophe_is_refused(redis_server, apostrophe):
    query = f"Why doesn{apostrophe}t my card work abroad?"
    assert not served(redis_server, "Why does my card work abroad?", query), "negated question served"


# --- 2. combining marks and emoji are dropped: different questions normalise to one text ---------------


@pytest.mark.parametrize(
    "stored, query",
    [
        ("What does ma\u0301 mean in Vietnamese?", "What does ma\u0300 mean in Vietnamese?"),  # NFD: má / mà
        ("What does \U0001f44d mean in a code review?", "What does \U0001f44e mean in a code review?"),
    ],
    ids=["combining-marks", "emoji"],
)
def test_different_unicode_questions_do_not_share_an_answer(redis_server, stored, query):
    assert not served(redis_server, stored, query, cosine=1.0), "another question served at cosine 1.0"


# --- 3. named entities in non-ASCII (cased) scripts are invisible to the entity rule --------------------


def test_control_ascii_entities_are_refused(redis_server):
    assert not served(
        redis_server, "What is the weather like in Moscow today?", "How is the weather in Kiev today?"
    )


def test_cyrillic_entities_are_refused(redis_server):
    assert not served(
        redis_server,
        "What is the weather like in \u041c\u043e\u0441\u043a\u0432\u0430 today?",
        "How is the weather in \u041a\u0438\u0435\u0432 today?",
    ), "a question about another city served"


# --- 4. numbers the number rule does not see ------------------------------------------------------------


def test_control_digit_fractions_are_refused(redis_server):
    assert not served(
        redis_server, "How many grams are in 1/2 cup of flour?", "What is 1/4 cup of flour in grams?"
    )


@pytest.mark.parametrize(
    "stored, query",
    [
        ("How many grams are in \u00bd cup of flour?", "What is \u00bc cup of flour in grams?"),
        ("How much tax do I pay on sixty dollars?", "What is the tax on seventy dollars?"),
        ("What is 10\u00b2 in binary?", "Write 10\u00b3 in binary"),
    ],
    ids=["vulgar-fractions", "number-words", "superscripts"],
)
def test_other_numbers_are_refused(redis_server, stored, query):
    assert not served(redis_server, stored, query), "a question with other numbers served"


# --- 5. a store whose embedding raises must not raise ---------------------------------------------------


class FailingEmbedder:
    dim = 384

    def embed(self, texts):
        raise RuntimeError("MiniLM forward pass failed (out of memory)")

    def fits(self, texts):
        return [True] * len(texts)


@pytest.mark.parametrize("coalesced", [False, True], ids=["plain", "coalesced"])
def test_a_store_whose_embedding_raises_is_counted_not_raised(redis_server, coalesced):
    embedder = CoalescingEmbedder(FailingEmbedder()) if coalesced else FailingEmbedder()
    c = SemanticResponseCache(redis_server, f"fp-{uuid.uuid4().hex[:8]}", embedder, verifier=None)
    try:
        assert c.store("seed question", "t", GREEDY, answer("x"), embedding=np.ones(384, np.float32))
        assert c.lookup("How do I reset my password?", "t", GREEDY) is None  # the lookup: a counted miss
        assert c.stats.embed_errors == 1
        assert c.store("How do I reset my password?", "t", GREEDY, answer("x")) is False
        assert c.stats.embed_errors == 2
    finally:
        c.close()


# --- 7. the opener rule merges "quickest way" and "easiest way" -----------------------------------------


def test_quickest_and_easiest_way_are_not_one_question(redis_server):
    assert not served(
        redis_server,
        "What is the quickest way to learn Spanish?",
        "What is the easiest way to learn Spanish?",
        1.0,
    )


# --- 6. an overruled guard rejection needs at least the cut a guard-passing hit needs -----------------


class Fixed:
    def __init__(self, p):
        self.p = p

    def probability(self, pairs):
        return np.full(len(pairs), self.p)


def one_candidate(query: str, stored: str, score: float = 0.95) -> list[Candidate]:
    tm = _TenantMatrix(None, ["id0"], [stored], ["a"], ["s"], np.zeros(1), np.zeros((1, 2), np.float32))
    return [Candidate(0, score, 0.4, _Query(query), tm)]


def test_a_guard_rejected_candidate_needs_at_least_the_pair_cut():
    check = PairCheck(Fixed(0.96), min_probability=0.99)  # semantic_pair_min=0.99, default overrule_min 0.95
    ok = one_candidate("How do I reset my password?", "How can I reset my password?")
    assert select(ok, 0.8, 0.8, None, 1, pair_check=check) is None  # 0.96 < 0.99: refused, as configured
    other_numbers = one_candidate("Is a short walk enough?", "Is a 30 minute walk enough?")
    assert not other_numbers[0].verdict().ok and other_numbers[0].verdict().reason == "numbers"
    assert select(other_numbers, 0.8, 0.8, None, 1, pair_check=check) is None, (
        "a candidate the guard refused (other numbers) served at a probability a passing one is refused at"
    )


def test_another_value_is_never_overruled():
    """Both questions name numbers and they differ ("question 0" / "question 2" after a long shared
    context): another question, however sure the pair classifier is (it read 0.99 for such a pair)."""
    context = "Shared context for the fault exploration, repeated for blocks. " * 6
    check = PairCheck(Fixed(0.999))
    cands = one_candidate(f"{context} kv question 0", f"{context} kv question 2")
    assert cands[0].verdict().reason == "values"
    assert select(cands, 0.8, 0.8, None, 1, pair_check=check) is None
    one_sided = one_candidate("Is a short walk enough?", "Is a 30 minute walk enough?")
    assert select(one_sided, 0.8, 0.8, None, 1, pair_check=check) is not None, "a number on one side only"
