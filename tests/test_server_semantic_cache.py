"""The semantic response cache on the serving path (opt-in): paraphrases hit; negations, tenants miss."""

from __future__ import annotations

import time

import pytest

from client.generate import generate
from client.metrics import metric_total, scrape_metrics
from tests.conftest import warm_stack

GREEDY = {"max_tokens": 10, "ignore_eos": True}


@pytest.fixture(scope="module")
def semantic_stack(tmp_path_factory):
    with warm_stack(tmp_path_factory.mktemp("semantic"), LLM_SEMANTIC_CACHE="true") as stack:
        yield stack


def cached(stack) -> float:
    return metric_total(
        scrape_metrics(stack.metrics_url), "llm_engine_requests_finished_total", status="cached"
    )


def test_a_paraphrase_is_answered_from_the_semantic_cache(semantic_stack):
    url = semantic_stack.grpc_url
    original = generate(url, "How do I reset my password?", sampling=GREEDY, tenant="acme")
    # answers are stored in order by one background writer: once a later request is served from the
    # cache, the original's exact and semantic entries are stored too
    marker = "An unrelated request that orders the writer"
    generate(url, marker, sampling=GREEDY, tenant="acme")
    deadline, before = time.monotonic() + 30, cached(semantic_stack)
    while cached(semantic_stack) == before and time.monotonic() < deadline:
        generate(url, marker, sampling=GREEDY, tenant="acme")
    hits = cached(semantic_stack)
    paraphrase = generate(url, "How can I reset my password?", sampling=GREEDY, tenant="acme")
    assert cached(semantic_stack) == hits + 1 and paraphrase.text == original.text

    hits = cached(semantic_stack)
    generate(url, "How do I reset my password?", sampling=GREEDY, tenant="globex")
    generate(url, "How do I not reset my password?", sampling=GREEDY, tenant="acme")
    assert cached(semantic_stack) == hits, "another tenant and a negated question never hit"


def test_the_embedders_passes_and_texts_are_in_the_metrics(semantic_stack):
    """The loader puts the coalescing embedder in front of MiniLM; its counters reach
    `llm_engine_cache_total{tier="semantic"}` (`embed_texts / embed_passes`: texts per forward pass)."""
    generate(semantic_stack.grpc_url, "How do I water a cactus?", sampling=GREEDY, tenant="acme")

    def counter(name: str) -> float:
        metrics = scrape_metrics(semantic_stack.metrics_url)
        return metric_total(metrics, "llm_engine_cache_total", tier="semantic", counter=name)

    deadline = time.monotonic() + 30
    while counter("embed_passes") == 0 and time.monotonic() < deadline:
        generate(semantic_stack.grpc_url, "How do I water a cactus?", sampling=GREEDY, tenant="acme")
    passes, texts = counter("embed_passes"), counter("embed_texts")
    assert passes >= 1 and texts >= passes and counter("embed_calls") >= passes
