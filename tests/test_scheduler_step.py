"""The scheduler step hashes each cacheable request's exact response-cache key (the engine's process
then does not), with the same fingerprint as the engine, from the same model parameters."""

from __future__ import annotations

import json

import pytest

from cache.fingerprint import model_max_len, serving_fingerprint
from cache.response_cache import ExactResponseCache, exact_key, exact_namespace
from scheduler.errors import RequestError
from scheduler.step import SchedulerStep
from scheduler.tiers import TierTable
from scheduler.validation import Limits


def step(fingerprint: str | None) -> SchedulerStep:
    return SchedulerStep(
        encode=lambda text, tenant: [ord(c) for c in text],
        limits=Limits(max_prompt_tokens=100, max_new_tokens=64),
        tiers=TierTable.defaults(),
        exact_fingerprint=fingerprint,
    )


def prepare(s: SchedulerStep, sampling: dict, cache: str | None = None, tenant: str = "t"):
    return s.prepare("hello", json.dumps(sampling), True, None, None, tenant, now_ns=1, cache=cache)


@pytest.mark.parametrize(
    ("sampling", "cache", "hashed"),
    [
        ({"temperature": 0}, None, True),
        ({"temperature": 0.8, "seed": 3}, "use", True),
        ({"temperature": 0.8}, None, False),  # not replayable: never cached, no key
        ({"temperature": 0}, "kv-only", False),  # no response cache for this request
        ({"temperature": 0}, "bypass", False),
    ],
)
def test_a_key_is_hashed_for_the_requests_the_response_cache_serves_and_equals_the_engines(
    sampling, cache, hashed
):
    prepared = prepare(step("fp-1"), sampling, cache)
    want = exact_key("fp-1", prepared.input_ids, prepared.params) if hashed else ""
    assert prepared.params.response_key == want
    if hashed:
        engine_side = ExactResponseCache.__new__(ExactResponseCache)
        engine_side.fingerprint, engine_side.namespace = "fp-1", exact_namespace("fp-1")
        assert engine_side.claimed(prepared.params) == want
        assert engine_side.key(prepared.input_ids, prepared.params) == want


def test_no_key_without_the_engines_response_cache_and_a_tenant_changes_it():
    assert prepare(step(None), {"temperature": 0}).params.response_key == ""
    s = step("fp-1")
    assert (
        prepare(s, {"temperature": 0}, tenant="a").params.response_key
        != prepare(s, {"temperature": 0}, tenant="b").params.response_key
    )


def test_the_serving_fingerprint_follows_the_engines_parameters(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 1024}))
    assert model_max_len(tmp_path, 2048) == 1024 and model_max_len(tmp_path, 512) == 512
    base = serving_fingerprint(tmp_path, 1024, "float32")
    assert base.endswith("|float32|slot-kv-v1")
    assert (
        base
        != serving_fingerprint(tmp_path, 1024, "bfloat16")
        != serving_fingerprint(tmp_path, 512, "float32")
    )


def test_a_prompt_past_the_character_bound_is_refused_before_it_is_tokenized():
    """Tokenizing 32 MB took the single scheduler instance 15 s while every other request waited."""

    def encode(text: str, tenant: str) -> list[int]:
        raise AssertionError("a prompt that cannot fit was tokenized")

    limits = Limits(max_prompt_tokens=100, max_new_tokens=64, max_prompt_chars=1000)
    s = SchedulerStep(encode=encode, limits=limits, tiers=TierTable.defaults())
    with pytest.raises(RequestError) as info:
        s.prepare("x" * 1001, None, True, None, None, "t", now_ns=1)
    assert info.value.code == "INVALID_ARG"
    assert "more than 100 tokens; allowed: at most 100 tokens (its 1001 characters" in info.value.message
    assert prepare(step(None), {"max_tokens": 4}).input_ids  # a prompt under the bound is tokenized
