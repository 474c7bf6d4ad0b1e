"""The sampling ranges both steps enforce: the scheduler step on `sampling_parameters`, the engine on
the `request_params` a client may send to llm_engine directly. Found in review: the engine enforced
none of them (max_tokens 600 generated in full, top_p 0 failed as INTERNAL, stop strings unbounded)."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.sampling import Sampler
from engine.requests import check_params
from scheduler.errors import RequestError
from scheduler.messages import EngineRequestParams
from scheduler.sampling_rules import MAX_STOP_CHARS, MAX_STOP_SEQUENCES, check_sampling
from scheduler.validation import Limits, parse_sampling_parameters

CAP = 64
LIMITS = Limits(max_prompt_tokens=100, max_new_tokens=CAP)
# (field, out-of-range value): each one the scheduler step refuses
OUT_OF_RANGE = [
    ("max_tokens", CAP + 1),
    ("max_tokens", 0),
    ("max_tokens", -5),
    ("temperature", 50.0),
    ("temperature", -0.1),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_k", -1),
    ("seed", -1),
    ("seed", 2**63),
    ("stop", [f"s{i}" for i in range(MAX_STOP_SEQUENCES + 1)]),
    ("stop", ["x" * (MAX_STOP_CHARS + 1)]),
    ("stop", [""]),
    ("stop", ["ok", "\ud800"]),
]


def engine_refusal(params: EngineRequestParams, cap: int = CAP) -> RequestError:
    with pytest.raises(RequestError) as info:
        check_params(params, cap)
    assert info.value.code == "INVALID_ARG"
    return info.value


@pytest.mark.parametrize(("key", "value"), OUT_OF_RANGE, ids=[f"{k}={str(v)[:12]}" for k, v in OUT_OF_RANGE])
def test_the_engine_refuses_what_the_step_refuses_in_the_same_words(key: str, value: object) -> None:
    with pytest.raises(RequestError) as step:
        parse_sampling_parameters(json.dumps({key: value}), LIMITS)
    raw = {"temperature": 0.8, key: value}  # as a direct client sends it: JSON through from_bytes
    engine = engine_refusal(EngineRequestParams.from_bytes(json.dumps(raw).encode()))
    assert engine.message.startswith(f"request_params.{key} ")
    assert engine.message.removeprefix("request_params.") == step.value.message.removeprefix(
        "sampling_parameters."
    )


def test_values_at_the_edges_of_each_range_pass_both_steps() -> None:
    edges = {"max_tokens": CAP, "temperature": 2.0, "top_p": 1.0, "top_k": 0, "seed": 2**63 - 1,
             "stop": ["y" * MAX_STOP_CHARS] * MAX_STOP_SEQUENCES, "ignore_eos": True}  # fmt: skip
    sampling = parse_sampling_parameters(json.dumps(edges), LIMITS)
    params = EngineRequestParams(**sampling)
    check_params(params, CAP)
    check_params(replace(params, max_tokens=1, top_p=1e-9, top_k=10**9, seed=0, stop=()), CAP)


def test_the_engine_holds_max_tokens_to_its_own_configured_cap() -> None:
    assert "1..512" in engine_refusal(EngineRequestParams(max_tokens=513), 512).message
    check_params(EngineRequestParams(max_tokens=512), 512)
    assert "1..8" in engine_refusal(EngineRequestParams(max_tokens=9), 8).message


def test_check_sampling_normalizes_only_the_keys_it_is_given() -> None:
    assert check_sampling({"stop": "###", "temperature": 1e-300, "nope": 1}, CAP, "x") == {
        "stop": ("###",),
        "temperature": 0.0,
    }
    with pytest.raises(RequestError, match=r"^x\.ignore_eos must be true or false, got 1$"):
        check_sampling({"ignore_eos": 1}, CAP, "x")


def test_a_direct_request_names_a_tenant_as_the_step_allows() -> None:
    for tenant in ("", "a b", "t" * 65, "../x"):
        assert "invalid tenant" in engine_refusal(EngineRequestParams(tenant=tenant)).message
    check_params(EngineRequestParams(tenant="acme-1.eu_west"), CAP)


def test_the_engine_reads_max_new_tokens_as_the_scheduler_step_does(monkeypatch, tmp_path) -> None:
    """Both config.pbtxt files read LLM_MAX_NEW_TOKENS (default 512): the engine's copy of the cap."""
    repository = Path(__file__).resolve().parents[1] / "model_repository"
    found = {
        step: re.findall(r'key: "max_new_tokens" value: \{ string_value: "([^"]*)"', (repository / step /
                         "config.pbtxt").read_text())
        for step in ("slo_scheduler", "llm_engine")
    }  # fmt: skip
    setting = "${LLM_MAX_NEW_TOKENS:-512}"
    assert found == {"slo_scheduler": [setting], "llm_engine": [setting]}
    monkeypatch.delenv("LLM_MAX_NEW_TOKENS", raising=False)
    params = {"model_dir": str(tmp_path), "max_new_tokens": setting}
    assert EngineConfig.from_parameters(params).max_new_tokens == 512
    monkeypatch.setenv("LLM_MAX_NEW_TOKENS", "100")
    assert EngineConfig.from_parameters(params).max_new_tokens == 100
    monkeypatch.setenv("LLM_MAX_NEW_TOKENS", "0")
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        EngineConfig.from_parameters(params)


@pytest.mark.parametrize(
    "raw",
    [
        '{"temperature": "\\ud800"}',
        '{"max_tokens": "\\ud800"}',
        '{"top_p": ["\\udfff"]}',
        '{"ignore_eos": "\\ud800"}',
        '{"stop": ["' + "\\ud800" * 65 + '"]}',
    ],
)
def test_the_error_for_a_lone_surrogate_value_can_be_sent_as_utf8(raw: str) -> None:
    """Triton sends the message back as UTF-8: a lone surrogate in the value shown must come escaped."""
    with pytest.raises(RequestError) as info:
        parse_sampling_parameters(raw, LIMITS)
    assert info.value.code == "INVALID_ARG"
    assert "\\ud8" in info.value.message or "\\udf" in info.value.message
    info.value.message.encode("utf-8")


def test_a_tiny_top_p_keeps_the_most_likely_token() -> None:
    """top_p 1e-50 is in (0, 1]; as float32 it is 0, which once dropped every token (NaN probabilities,
    torch.multinomial raising: the request failed as INTERNAL at its first token)."""
    params = parse_sampling_parameters('{"temperature": 0.7, "top_p": 1e-50, "seed": 1}', LIMITS)
    sampler = Sampler(
        params["temperature"], params["top_p"], params["top_k"], params["seed"], torch.device("cpu")
    )
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    assert [sampler.pick(logits) for _ in range(5)] == [int(torch.argmax(logits))] * 5
