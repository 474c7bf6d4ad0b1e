"""Semantic response cache against a real redis-server and the real all-MiniLM-L6-v2 embedder."""

from __future__ import annotations

import os
import time
import uuid

import numpy as np
import pytest

from cache.embedder import MiniLMEmbedder
from cache.semantic_cache import (
    QuestionGuard,
    SemanticResponseCache,
    content_words,
    frame_words,
    minimal_pair,
    normalize_question,
)
from deploy.launch import find_free_port
from scheduler.messages import EngineRequestParams
from tests.conftest import answer
from tests.test_redis_kv_store import FakeClock

GREEDY = EngineRequestParams(max_tokens=32)
QUESTION = "How do I reset my password?"
PARAPHRASE = "I forgot my password, how can I set a new one?"


@pytest.fixture(scope="module")
def embedder():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return MiniLMEmbedder()


@pytest.fixture
def cache(redis_server, embedder):
    c = SemanticResponseCache(redis_server, f"fp-{uuid.uuid4().hex[:8]}", embedder, threshold=0.75)
    yield c
    c.close()


def test_embedder_shape_norm_and_similarity(embedder):
    v = embedder.embed([QUESTION, PARAPHRASE, "What is the capital of France?"])
    assert v.shape == (3, 384) and v.dtype == np.float32
    assert np.allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    assert v[0] @ v[1] > 0.8 > v[0] @ v[2]
    assert embedder.embed([]).shape == (0, 384)


def test_a_coalescing_embedders_counters_are_in_the_caches_snapshot(redis_server, embedder, cache):
    from cache.embed_coalescer import CoalescingEmbedder

    counted = SemanticResponseCache(redis_server, cache.fingerprint, CoalescingEmbedder(embedder))
    try:
        assert counted.store(QUESTION, "t1", GREEDY, answer(" an answer"))
        counted.lookup(PARAPHRASE, "t1", GREEDY)
        stats = counted.snapshot()
        assert stats["stores"] == 1 and (stats["embed_passes"], stats["embed_texts"]) == (2, 2)
        assert "embed_passes" not in cache.snapshot()  # an embedder without counters adds none
    finally:
        counted.close()


def test_a_missed_prompts_store_reuses_its_lookups_embedding_within_its_tenant(redis_server, embedder, cache):
    from cache.embed_coalescer import CoalescingEmbedder

    counted = SemanticResponseCache(redis_server, cache.fingerprint, CoalescingEmbedder(embedder))
    try:
        assert counted.store(QUESTION, "t1", GREEDY, answer(" an answer"))  # one pass
        assert counted.store(QUESTION, "t2", GREEDY, answer(" t2's answer"))  # one pass: another tenant
        other = "What is the capital of France?"
        assert counted.lookup(other, "t1", GREEDY) is None  # a miss: one pass
        assert counted.store(other, "t1", GREEDY, answer(" Paris."))  # its answer: none
        assert counted.lookup(other, "t2", GREEDY) is None  # t1 asked it, but t2's lookup embeds: one pass
        stats = counted.snapshot()
        assert (stats["embed_passes"], stats["embed_recent_reused"]) == (4, 1)
        assert counted.lookup("what's the capital of france", "t1", GREEDY).answer == answer(" Paris.")
    finally:
        counted.close()
    swapped = SemanticResponseCache(redis_server, cache.fingerprint, embedder)
    try:
        assert swapped.lookup(QUESTION, "t3", GREEDY) is None  # no entries: nothing embedded yet
        swapped._embed("a question", "t3")
        swapped.embedder = CoalescingEmbedder(embedder)  # another model's vectors must not be reused
        swapped._embed("a question", "t3")
        assert swapped.snapshot()["embed_recent_reused"] == 0
    finally:
        swapped.close()
    off = SemanticResponseCache(redis_server, cache.fingerprint, embedder, recent_vectors=0)
    try:
        assert off.recent is None and "embed_recent_reused" not in off.snapshot()
    finally:
        off.close()


def test_paraphrase_hits_and_negation_does_not(cache):
    assert cache.store(QUESTION, "t1", GREEDY, answer(" Open Settings > Security > Reset."))
    hit = cache.lookup(PARAPHRASE, "t1", GREEDY)
    assert hit is not None and hit.prompt == QUESTION and hit.score >= 0.75
    assert hit.answer == answer(" Open Settings > Security > Reset.")
    negated = "How do I not reset my password?"
    assert (
        cache.embedder.embed([negated])[0] @ cache.embedder.embed([QUESTION])[0] > 0.75
    )  # cosine alone would hit
    assert cache.lookup(negated, "t1", GREEDY) is None
    assert cache.snapshot()["guard_rejections"] >= 1


@pytest.mark.parametrize(
    "stored, query",
    [
        ("How do I convert Celsius to Fahrenheit?", "How do I convert Fahrenheit to Celsius?"),
        ("How do I increase the font size?", "How do I decrease the font size?"),
        ("Should I take this medicine before meals?", "Should I take this medicine after meals?"),
        ("Is Python faster than Java?", "Is Java faster than Python?"),
        ("Do I need a visa to visit Canada?", "Do I need a visa to visit Mexico?"),
        ("Can I get a refund within 14 days?", "Can I get a refund within 30 days?"),
        ("Is it safe to take ibuprofen with food?", "Is it safe to take ibuprofen without food?"),
        ("How do I lock my screen?", "How do I unlock my screen?"),
        ("Should I exercise when I have a cold?", "Should I avoid exercise when I have a cold?"),
        ("Is it safe to eat raw eggs?", "Is it unsafe to eat raw eggs?"),
        ("How do I cancel my booking?", "Is there a fee for cancelling my booking?"),
        # words swapped in place: no word list names these pairs
        ("How long should I boil an egg for a soft yolk?", "How long should I boil an egg for a hard yolk?"),
        ("What is the daily withdrawal limit?", "What is the weekly withdrawal limit?"),
        ("How do I convert grams of flour to cups?", "How do I convert cups of flour to grams?"),
        # the same frame less articles and possessives: still one slot of a template changed
        ("What is the daily withdrawal limit?", "What is my weekly withdrawal limit?"),
        # a synonym swapped into an unchanged frame looks the same, and is turned down too
        ("How do I cancel my gym membership online?", "How do I end my gym membership online?"),
    ],
)
def test_guard_rejects_reversals_negations_and_other_entities(stored, query):
    assert not QuestionGuard().compatible(stored, query).ok
    assert not QuestionGuard().compatible(query, stored).ok


@pytest.mark.parametrize(
    "stored, query",
    [
        (QUESTION, PARAPHRASE),
        ("How do I turn off notifications?", "How can I disable push notifications?"),
        (
            "Can I switch from monthly to annual billing?",
            "Is it possible to change my billing from monthly to yearly?",
        ),
        ("My verification code never arrived.", "I didn't receive the confirmation code."),
        ("Is it normal to feel tired after a vaccine?", "Can a vaccine make you feel exhausted afterwards?"),
        (
            "Do you refund unused months if I cancel early?",
            "If I cancel early, can I get a refund for the months I didn't use?",
        ),
        ("How do I reset my router?", "What's the way to reset my wireless router?"),  # a word added
        ("How do I convert grams to cups?", "What's the conversion from grams to cups?"),  # a word's form
        # a word swapped, and the rest reworded too: a rewording, left to the embedding
        ("How do I make an HTTP request in Python?", "How can I send an HTTP request from Python?"),
        (
            "How do I pair my phone with the car's Bluetooth?",
            "How can I connect my phone to my car over Bluetooth?",
        ),
        ("How do I cancel my hotel reservation?", "I need to cancel my hotel booking, how do I do it?"),
    ],
)
def test_guard_accepts_paraphrases(stored, query):
    assert QuestionGuard().compatible(stored, query).ok
    assert QuestionGuard().compatible(query, stored).ok


def test_normalize_question_and_content_words():
    assert normalize_question("Hi, can you tell me how can I reset my router\u2019s password?") == (
        "how do i reset my router password"
    )
    assert normalize_question("What's the best way to combine two dicts in Python?") == (
        "how do i combine two dicts in python"
    )
    assert normalize_question("I can't log in - what's wrong?") == "i cannot log in what is wrong"
    assert normalize_question("Is there a way to turn on 2FA?") == "how do i turn on 2fa"
    assert content_words("How do I merge two dictionaries in Python?") == (
        "merge",
        "two",
        "dictionary",
        "python",
    )
    assert minimal_pair(("boil", "egg", "soft", "yolk"), ("boil", "egg", "hard", "yolk"))
    assert not minimal_pair(("boil", "egg"), ("boil", "egg")), "nothing swapped"
    assert not minimal_pair(("reset", "router"), ("reset", "wireless", "router")), "only added"
    assert not minimal_pair(("egg", "yolk"), ("egg", "white")), "one shared word is not a frame"
    assert not minimal_pair(("a", "b", "c", "d", "e"), ("a", "b", "x", "y", "z")), "reworded, not swapped"
    assert frame_words("How do I make an HTTP request in Python?") == ("how", "do", "i", "in")
    assert (
        frame_words("What is the daily limit?") == frame_words("What is my weekly limit?") == ("what", "is")
    )


def test_queries_are_normalised_before_embedding(cache, embedder):
    vec = cache.embed_queries(["Can you tell me how can I reset my password?"])[0]
    np.testing.assert_allclose(vec, embedder.embed(["how do i reset my password"])[0], atol=1e-5)


def _at_cosine(base: np.ndarray, other: np.ndarray, cosine: float) -> np.ndarray:
    """A unit vector at `cosine` to `base`, in the plane of `base` and `other`."""
    ortho = other - (other @ base) * base
    ortho /= np.linalg.norm(ortho)
    return (cosine * base + np.sqrt(1 - cosine**2) * ortho).astype(np.float32)


def test_the_lower_band_accepts_differently_worded_questions_only(redis_server, embedder):
    # without verifier weights the band falls back to the content-word overlap rule
    c = SemanticResponseCache(
        redis_server, f"fp-{uuid.uuid4().hex[:8]}", embedder, threshold=0.8, verifier=None
    )
    rng = np.random.default_rng(0)
    base = rng.standard_normal(384).astype(np.float32)
    base /= np.linalg.norm(base)
    stored = "How do I cancel my subscription?"
    assert c.store(stored, "t", GREEDY, answer("cancel answer"), embedding=base)
    reworded, swapped = "What are the steps to end my plan?", "How do I pause my subscription?"
    near = _at_cosine(base, rng.standard_normal(384).astype(np.float32), 0.75)
    assert c.low_threshold == 0.8, "the lower band is off unless asked for"
    assert c.lookup(reworded, "t", GREEDY, embedding=near) is None
    hit = c.lookup(reworded, "t", GREEDY, embedding=near, low_threshold=0.7)
    assert hit is not None and hit.band == "low" and hit.prompt == stored
    # "pause my subscription" shares a third of its content words with the entry: the band turns it down
    assert c.lookup(swapped, "t", GREEDY, embedding=near, low_threshold=0.7) is None
    assert c.snapshot()["low_band_rejections"] == 1
    high = _at_cosine(base, rng.standard_normal(384).astype(np.float32), 0.85)
    assert c.lookup(swapped, "t", GREEDY, embedding=high, low_threshold=0.7).band == "high"
    c.use_guard = False  # the ablation: cosine only, so no lower band either
    assert c.lookup(reworded, "t", GREEDY, embedding=near, low_threshold=0.7) is None
    assert (
        SemanticResponseCache(
            redis_server, "fp", embedder, threshold=0.8, low_threshold=0.9, verifier=None
        ).low_threshold
        == 0.8
    )
    c.close()


def test_tenant_a_never_gets_tenant_b_entry(cache):
    assert cache.store(QUESTION, "tenant-b", GREEDY, answer("b's answer"))
    assert cache.lookup(QUESTION, "tenant-a", GREEDY) is None
    assert cache.lookup(PARAPHRASE, "tenant-a", GREEDY) is None
    assert cache.lookup(QUESTION, "tenant-b", GREEDY).answer == answer("b's answer")
    # b's records copied under a's keys fail the checksum (it covers the tenant) and are deleted
    kb, ka = cache._keys("tenant-b"), cache._keys("tenant-a")
    for src, dst in zip(kb[:3], ka[:3]):
        cache.client.copy(src, dst)
    cache.client.incr(ka[3])
    assert cache.lookup(QUESTION, "tenant-a", GREEDY) is None
    assert cache.snapshot()["corrupt"] == 1
    assert cache.client.hlen(ka[1]) == 0


def test_only_same_sampling_signature_and_deterministic_requests(cache):
    assert cache.store(QUESTION, "t", GREEDY, answer("x"))
    assert cache.lookup(QUESTION, "t", EngineRequestParams(max_tokens=32, stop=("\n",))) is None
    assert cache.lookup(QUESTION, "t", EngineRequestParams(max_tokens=32, ignore_eos=True)) is None
    sampled = EngineRequestParams(max_tokens=32, temperature=0.8)
    assert cache.store(QUESTION, "t", sampled, answer("y")) is False
    assert cache.lookup(QUESTION, "t", sampled) is None
    assert cache.snapshot()["uncacheable"] == 2
    seeded = EngineRequestParams(max_tokens=32, temperature=0.8, seed=5)
    assert cache.store(QUESTION, "t", seeded, answer("z"))
    assert cache.lookup(PARAPHRASE, "t", seeded).answer == answer("z")
    # exclude_input_in_output does not change the completion (the engine puts the prompt in front)
    excl = EngineRequestParams(max_tokens=32, exclude_input_in_output=True)
    assert cache.lookup(PARAPHRASE, "t", excl).answer == answer("x")


@pytest.mark.parametrize("damage", ["truncated vector", "lone surrogate", "field name not utf-8"])
def test_corrupted_entries_are_rejected_and_deleted(cache, damage):
    cache.store(QUESTION, "t", GREEDY, answer("good answer"))
    cache.store("How do I track my package?", "t", GREEDY, answer("tracking answer"))
    emb_key, doc_key, age_key, ver_key = cache._keys("t")
    victim = next(k for k, v in cache.client.hgetall(doc_key).items() if b"reset my password" in v)
    if damage == "truncated vector":
        cache.client.hset(emb_key, victim, cache.client.hget(emb_key, victim)[:100])
    elif damage == "lone surrogate":  # "\ud800" decodes to a str UTF-8 cannot encode: must not raise
        doc = cache.client.hget(doc_key, victim)
        cache.client.hset(doc_key, victim, doc.replace(b"reset my password", b"\\ud800"))
    else:  # all three values moved to a name that is not UTF-8: deleted by those bytes, not a replaced text
        for key in (emb_key, doc_key):
            value = cache.client.hget(key, victim)
            cache.client.hdel(key, victim)
            cache.client.hset(key, b"\xff\xfe" + victim, value)
        written = cache.client.zscore(age_key, victim)
        cache.client.zrem(age_key, victim)
        cache.client.zadd(age_key, {b"\xff\xfe" + victim: written})
        victim = b"\xff\xfe" + victim
    cache.client.incr(ver_key)
    assert cache.lookup(PARAPHRASE, "t", GREEDY) is None
    assert cache.snapshot()["corrupt"] == 1
    assert not cache.client.hexists(doc_key, victim) and not cache.client.hexists(emb_key, victim)
    assert cache.lookup("How can I track my package?", "t", GREEDY).answer == answer("tracking answer")


def test_an_entry_half_evicted_by_a_bounded_redis_is_deleted_as_incomplete_not_corrupt(cache):
    """A bounded Redis evicts keys, not entries: the embeddings hash may go while the documents stay."""
    cache.store(QUESTION, "t", GREEDY, answer("good answer"))
    emb_key, doc_key, _, ver_key = cache._keys("t")
    cache.client.delete(emb_key)  # what volatile-lru does to one of the tenant's keys
    cache.client.incr(ver_key)
    assert cache.lookup(PARAPHRASE, "t", GREEDY) is None
    stats = cache.snapshot()
    assert (stats["incomplete"], stats["corrupt"]) == (1, 0)
    assert cache.client.hlen(doc_key) == 0


def test_a_tenant_key_of_another_type_is_deleted_without_opening_the_breaker(cache):
    """HGETALL of a tenant key that holds a string fails with WRONGTYPE: bad values, not a Redis failure."""
    from cache.circuit_breaker import BreakerState, CircuitBreaker

    emb_key, _, _, ver_key = cache._keys("t")
    for _ in range(6):  # more than the breaker's failure threshold
        assert cache.store(QUESTION, "t", GREEDY, answer("an answer"))
        cache.client.delete(emb_key)
        cache.client.set(emb_key, b"not a hash")
        cache.client.incr(ver_key)
        assert cache.lookup(PARAPHRASE, "t", GREEDY) is None
        assert cache.client.exists(emb_key) == 0
    assert cache.snapshot()["corrupt"] == 6 and cache.snapshot()["errors"] == 0
    assert cache.breaker.state is BreakerState.CLOSED
    assert cache.store(QUESTION, "t", GREEDY, answer("again"))
    assert cache.lookup(PARAPHRASE, "t", GREEDY).answer == answer("again")
    clock = FakeClock()  # as the half-open probe after an outage, the WRONGTYPE reply closes the breaker
    cache.breaker = CircuitBreaker(failure_threshold=1, reset_timeout_s=5.0, clock=clock)
    cache.breaker.record_failure()
    clock.now = 5.0
    cache.client.delete(emb_key)
    cache.client.set(emb_key, b"not a hash")
    cache.client.incr(ver_key)
    assert cache.lookup(PARAPHRASE, "t", GREEDY) is None and cache.breaker.state is BreakerState.CLOSED


@pytest.mark.parametrize("bad", ["age", "ver"])
def test_a_bad_age_or_stamp_key_fails_one_store_is_deleted_and_opens_no_breaker(cache, bad):
    """The store script meets them (ZADD on a string, INCR on a non-integer): bad values of one tenant,
    not a Redis failure that would turn every tenant's lookups away."""
    from cache.circuit_breaker import BreakerState

    _, _, age_key, ver_key = cache._keys("t")
    cache.client.set(age_key if bad == "age" else ver_key, b"not what the script needs")
    for _ in range(6):  # more than the breaker's failure threshold
        cache.store(QUESTION, "t", GREEDY, answer("an answer"))
    assert cache.snapshot()["errors"] == 0 and cache.breaker.state is BreakerState.CLOSED
    assert cache.snapshot()["corrupt"] == 1 and cache.snapshot()["stores"] == 5
    assert cache.lookup(PARAPHRASE, "t", GREEDY).answer == answer("an answer")


def test_a_guard_check_on_document_long_prompts_is_linear_not_quadratic():
    """difflib over 10,000 repeated words a side took 7.5 s a check; a lookup runs one per candidate."""
    import time

    started = time.perf_counter()
    for query, entry in [
        ("x " * 10_000 + "kiwi", "x " * 10_000 + "apple"),
        ("x " * 5_000 + "kiwi " + "x " * 5_000, "x " * 5_000 + "apple " + "x " * 5_000),
    ]:
        verdict = QuestionGuard().compatible(query, entry)
        assert not verdict.ok and verdict.reason == "contrast:swapped-words"  # still one word swapped
    long_a = tuple(f"a{i}" for i in range(2000))
    assert not minimal_pair(long_a, tuple(reversed(long_a)))  # a middle too long to be one slot
    assert time.perf_counter() - started < 2.0


def test_the_embedder_says_which_texts_it_would_truncate(embedder):
    window = embedder.config.max_seq_length  # [CLS] and [SEP] count: "cat" is one token
    assert embedder.fits(["cat " * (window - 2), "cat " * (window - 1), "cat " * 10_000, ""]) == [
        True,
        False,
        False,
        True,
    ]
    assert embedder.fits(["cat " * (window - 3) + "unforgettableness"]) == [False]  # word pieces count


def test_prompts_past_the_embedders_window_are_neither_stored_nor_matched(cache):
    """A document then a question: MiniLM sees the first 256 tokens only, so two questions about one
    long document embed alike (cosine 1.0) and the guard's word checks pass them; one would have been
    served the other's answer."""
    document = " ".join(f"the report covers item {i} of the plan in some detail" for i in range(60))
    summary = f"Read this report and summarize it in one sentence: {document}"
    risks = f"{summary} then list the main risks it mentions, ranked by severity"
    vectors = cache.embed_queries([summary, risks])
    assert vectors[0] @ vectors[1] > 0.999  # what the cache would have compared
    assert not cache.store(summary, "t", GREEDY, answer("a one-sentence summary"))
    assert cache.lookup(risks, "t", GREEDY) is None
    assert cache.snapshot()["too_long"] == 2 and cache.snapshot()["stores"] == 0
    assert cache.store(QUESTION, "t", GREEDY, answer("an answer"))  # a question within the window still is
    assert cache.lookup(f"{document} {QUESTION}", "t", GREEDY) is None
    assert cache.lookup(PARAPHRASE, "t", GREEDY).answer == answer("an answer")
    assert cache.snapshot()["too_long"] == 3


def test_a_prompt_utf_8_cannot_encode_is_not_stored_and_raises_nothing(cache):
    assert not cache.store("How do I reset \ud800 my password?", "t", GREEDY, answer("an answer"))
    assert cache.snapshot()["uncacheable"] == 1 and cache.snapshot()["errors"] == 0


def test_matrix_is_cached_until_the_version_moves(cache):
    cache.store(QUESTION, "t", GREEDY, answer("a1"))
    assert cache.lookup(PARAPHRASE, "t", GREEDY).answer == answer("a1")
    first = cache._matrices["t"]
    assert cache.lookup(PARAPHRASE, "t", GREEDY) is not None
    assert cache._matrices["t"] is first  # not re-read
    cache.store("How do I track my package?", "t", GREEDY, answer("a2"))
    cache.lookup(PARAPHRASE, "t", GREEDY)
    assert cache._matrices["t"] is not first and len(cache._matrices["t"].ids) == 2


def test_max_entries_per_tenant_evicts_oldest(redis_server, embedder):
    c = SemanticResponseCache(redis_server, f"fp-{uuid.uuid4().hex[:8]}", embedder, max_entries_per_tenant=2)
    for i, q in enumerate(
        ["How do I reset my password?", "How do I track my package?", "Is there a dark mode?"]
    ):
        assert c.store(q, "t", GREEDY, answer(f"ans{i}"))
        time.sleep(0.01)
    assert c.client.hlen(c._keys("t")[1]) == 2
    assert c.snapshot()["evictions"] == 1
    assert c.lookup(QUESTION, "t", GREEDY) is None


def test_a_lowered_bound_is_reached_over_several_stores_not_in_one_script(redis_server, embedder):
    from cache.key_directory import MAX_TRIM_PER_WRITE

    fingerprint, vec = f"fp-{uuid.uuid4().hex[:8]}", embedder.embed([QUESTION])[0]
    wide = SemanticResponseCache(redis_server, fingerprint, embedder, max_entries_per_tenant=1000)
    narrow = SemanticResponseCache(redis_server, fingerprint, embedder, max_entries_per_tenant=10)
    try:
        for i in range(600):
            assert wide.store(f"question {i}?", "t", GREEDY, answer("a"), embedding=vec)
        held = []
        for i in range(3):
            assert narrow.store(f"new question {i}?", "t", GREEDY, answer("b"), embedding=vec)
            held.append(narrow.client.hlen(narrow._keys("t")[1]))
        assert held == [601 - MAX_TRIM_PER_WRITE, 602 - 2 * MAX_TRIM_PER_WRITE, 10]
        assert narrow.snapshot()["evictions"] == 603 - 10
    finally:
        wide.close()
        narrow.close()


def test_dead_redis_returns_no_hit_quickly(embedder):
    c = SemanticResponseCache(f"redis://localhost:{find_free_port()}/0", "fp", embedder, timeout_s=0.05)
    vec = embedder.embed([QUESTION])[0]
    t0 = time.perf_counter()
    for _ in range(20):
        assert c.lookup(QUESTION, "t", GREEDY, embedding=vec) is None
        assert c.store(QUESTION, "t", GREEDY, answer("x"), embedding=vec) is False
    assert time.perf_counter() - t0 < 1.0
    assert c.snapshot()["errors"] == 40


def test_a_store_that_fails_before_reaching_redis_leaves_the_breakers_probe(cache):
    """Half-open: an embedding of the wrong size raises before any call goes out, so the one probe the
    breaker lets through is still there for the next caller."""
    from cache.circuit_breaker import BreakerState, CircuitBreaker

    clock = FakeClock()
    cache.breaker = CircuitBreaker(failure_threshold=1, reset_timeout_s=5.0, clock=clock)
    cache.breaker.record_failure()
    clock.now = 5.0
    with pytest.raises(ValueError, match="dimensions"):
        cache.store(QUESTION, "t", GREEDY, answer("an answer"), embedding=np.ones(7, dtype=np.float32))
    assert cache.store(QUESTION, "t", GREEDY, answer("an answer"))
    assert cache.breaker.state is BreakerState.CLOSED


def test_the_engines_semantic_defaults_are_the_benchmarks_choice():
    """The bench's chosen threshold and pair cut live in cache/semantic_cache.py; the engine's config
    (kept free of the cache's imports) repeats them, and this keeps the two from drifting apart."""
    from cache.semantic_cache import DEFAULT_PAIR_MIN, DEFAULT_THRESHOLD
    from engine.config import EngineConfig

    config = EngineConfig()
    assert (config.semantic_threshold, config.semantic_pair_min) == (DEFAULT_THRESHOLD, DEFAULT_PAIR_MIN)
