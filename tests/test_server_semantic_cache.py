"""The semantic response cache on the serving path (opt-in): paraphrases hit; negations, tenants miss."""

from __future__ import annotations

import time
import uuid

import pytest

from client.generate import generate
from client.metrics import metric_total, scrape_metrics
from tests.conftest import wait_for, warm_stack

GREEDY = {"max_tokens": 10, "ignore_eos": True}


@pytest.fixture(scope="module")
def semantic_stack(tmp_path_factory):
    with warm_stack(tmp_path_factory.mktemp("semantic"), LLM_SEMANTIC_CACHE="true") as stack:
        yield stack


def cached(stack) -> float:
    return metric_total(
        scrape_metrics(stack.metrics_url), "llm_engine_requests_finished_total", status="cached"
    )


def semantic_counter(stack, name: str) -> float:
    metrics = scrape_metrics(stack.metrics_url)
    return metric_total(metrics, "llm_engine_cache_total", tier="semantic", counter=name)


def written(stack, tenant: str) -> None:
    """Wait until every answer computed so far is stored: one background writer stores answers in order,
    so once a later request (a marker of its own, asked until the exact cache holds it) is served from the
    cache, the earlier answers' exact and semantic entries are stored too."""
    marker = f"An unrelated request that orders the writer ({uuid.uuid4().hex[:8]})"
    generate(stack.grpc_url, marker, sampling=GREEDY, tenant=tenant)
    deadline, before = time.monotonic() + 30, cached(stack)
    while cached(stack) == before and time.monotonic() < deadline:
        generate(stack.grpc_url, marker, sampling=GREEDY, tenant=tenant)


def test_a_paraphrase_is_answered_from_the_semantic_cache(semantic_stack):
    url = semantic_stack.grpc_url
    original = generate(url, "How do I reset my password?", sampling=GREEDY, tenant="acme")
    written(semantic_stack, "acme")
    hits = cached(semantic_stack)
    paraphrase = generate(url, "How can I reset my password?", sampling=GREEDY, tenant="acme")
    assert cached(semantic_stack) == hits + 1 and paraphrase.text == original.text

    hits = cached(semantic_stack)
    generate(url, "How do I reset my password?", sampling=GREEDY, tenant="globex")
    generate(url, "How do I not reset my password?", sampling=GREEDY, tenant="acme")
    assert cached(semantic_stack) == hits, "another tenant and a negated question never hit"


def test_a_paraphrase_asking_fewer_tokens_is_served_the_first_ones_and_one_asking_more_computes(
    semantic_stack,
):
    """The entry holds the question's 10 token ids (not final: ignore_eos): a paraphrase allowed 4 gets its
    first 4, which are what the question's own run with 4 sends; one allowed 16 is a miss (`shorter`)."""
    url, tenant = semantic_stack.grpc_url, "initech"
    question, paraphrase = "How do I cancel my subscription?", "How can I cancel my subscription?"
    generate(url, question, sampling=GREEDY, tenant=tenant)
    written(semantic_stack, tenant)
    few = {**GREEDY, "max_tokens": 4}
    own = generate(url, question, sampling=few, tenant=tenant, cache="kv-only")
    hits, shorter = semantic_counter(semantic_stack, "hits"), semantic_counter(semantic_stack, "shorter")
    before = cached(semantic_stack)
    served = generate(url, paraphrase, sampling=few, tenant=tenant)
    assert cached(semantic_stack) == before + 1, "served from a cache; never asked, not from the exact one"
    assert served.text == own.text
    # counters are published at most once a second: what was read before may lag, never lead
    assert wait_for(lambda: semantic_counter(semantic_stack, "hits") >= hits + 1, 15)
    generate(url, paraphrase, sampling={**GREEDY, "max_tokens": 16}, tenant=tenant)
    assert cached(semantic_stack) == before + 1, "a budget past the entry's computes"
    assert wait_for(lambda: semantic_counter(semantic_stack, "shorter") >= shorter + 1, 15)


def test_the_embedders_passes_and_texts_are_in_the_metrics(semantic_stack):
    """The loader puts the coalescing embedder in front of MiniLM; its counters reach
    `llm_engine_cache_total{tier="semantic"}` (`embed_texts / embed_passes`: texts per forward pass)."""
    generate(semantic_stack.grpc_url, "How do I water a cactus?", sampling=GREEDY, tenant="acme")

    def counter(name: str) -> float:
        return semantic_counter(semantic_stack, name)

    deadline = time.monotonic() + 30
    while counter("embed_passes") == 0 and time.monotonic() < deadline:
        generate(semantic_stack.grpc_url, "How do I water a cactus?", sampling=GREEDY, tenant="acme")
    passes, texts = counter("embed_passes"), counter("embed_texts")
    assert passes >= 1 and texts >= passes and counter("embed_calls") >= passes
