"""Request validation: every rejection says what was wrong and what is allowed."""

from __future__ import annotations

import json

import pytest

from scheduler.errors import RequestError
from scheduler.messages import EngineRequestParams
from scheduler.tiers import TierTable
from scheduler.validation import Limits, build_request, parse_sampling_parameters

LIMITS = Limits(max_prompt_tokens=100, max_new_tokens=64)
TIERS = TierTable.defaults()


def build(
    text: str | bytes = "hello", sampling: str | bytes | None = None, **kw: object
) -> EngineRequestParams:
    args = {"stream": None, "exclude_input_in_output": None, "tier": None, "tenant": None, "cache": None}
    args.update(kw)
    count = args.pop("prompt_token_count", 3)
    return build_request(
        text, sampling, args["stream"], args["exclude_input_in_output"], args["tier"], args["tenant"],
        prompt_token_count=count, limits=LIMITS, tiers=TIERS, now_ns=42, cache=args["cache"],
    )  # fmt: skip


def rejected(raw: str | bytes | None) -> str:
    with pytest.raises(RequestError) as info:
        parse_sampling_parameters(raw, LIMITS)
    assert info.value.code == "INVALID_ARG"
    return str(info.value)


def test_defaults() -> None:
    params = build()
    assert params == EngineRequestParams(max_tokens=16, arrival_ns=42)
    assert params.greedy and params.tier == "standard" and params.tenant == "default"


def test_default_max_tokens_clamped_to_cap() -> None:
    assert parse_sampling_parameters(None, Limits(10, 4))["max_tokens"] == 4


@pytest.mark.parametrize("raw", [None, "", "  ", b"{}", "{}"])
def test_empty_sampling_gives_defaults(raw: str | bytes | None) -> None:
    assert parse_sampling_parameters(raw, LIMITS) == {
        "max_tokens": 16, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None, "stop": (),
        "ignore_eos": False,
    }  # fmt: skip


def test_full_sampling_round_trips_through_message() -> None:
    sampling = {
        "max_tokens": 64, "temperature": 0.7, "top_p": 0.9, "top_k": 40, "seed": 2**63 - 1,
        "stop": ["\n\n", "END"], "ignore_eos": True,
    }  # fmt: skip
    params = build(
        "hi", json.dumps(sampling).encode(), stream=True, exclude_input_in_output=True, tier=b"critical",
        tenant="acme-1.eu_west",
    )  # fmt: skip
    assert params.max_tokens == 64 and params.temperature == 0.7 and params.top_k == 40
    assert params.stop == ("\n\n", "END") and params.ignore_eos and params.seed == 2**63 - 1
    assert params.stream and params.exclude_input_in_output
    assert params.tier == "critical" and params.tenant == "acme-1.eu_west"
    assert EngineRequestParams.from_bytes(params.to_bytes()) == params


def test_single_stop_string_and_integer_temperature() -> None:
    out = parse_sampling_parameters('{"stop": "###", "temperature": 1, "top_p": 1}', LIMITS)
    assert out["stop"] == ("###",)
    assert out["temperature"] == 1.0 and isinstance(out["temperature"], float)
    assert parse_sampling_parameters('{"seed": null, "stop": null}', LIMITS)["seed"] is None


def test_a_stop_string_that_is_not_unicode_text_is_refused_with_an_encodable_message() -> None:
    """A lone surrogate escape parses as JSON but cannot be matched as UTF-8 or hashed into a key: let
    through, it raised in the engine step and failed every other running request."""
    for raw in ('{"stop": "\\ud800"}', '{"stop": ["ok", "a\\udfffb"]}'):
        msg = rejected(raw)
        assert "not Unicode text" in msg and "\\ud" in msg
        msg.encode("utf-8")
    assert parse_sampling_parameters('{"stop": "\\ud83d\\ude00"}', LIMITS)["stop"] == ("\U0001f600",)


def test_a_temperature_too_small_to_divide_by_is_greedy() -> None:
    """1e-300 passed the range check; dividing float32 logits by it gave inf, NaN probabilities and a
    torch.multinomial error inside the step that decodes every running request. Found in review."""
    assert parse_sampling_parameters('{"temperature": 1e-300}', LIMITS)["temperature"] == 0.0
    assert parse_sampling_parameters('{"temperature": 1e-5}', LIMITS)["temperature"] == 1e-5


def test_engine_request_params_from_bytes_checks_every_type() -> None:
    """llm_engine reads these bytes from whoever calls it; a temperature sent as a string raised in the
    engine step. Found in review."""
    params = EngineRequestParams(max_tokens=4, temperature=0.5, seed=3, stop=("x",), tenant="t")
    assert EngineRequestParams.from_bytes(params.to_bytes()) == params
    for bad in ('{"temperature": "0.7"}', '{"max_tokens": true}', '{"stop": "x"}', '{"seed": 1.5}', "[1]",
                '{"tenant": 5}', '{"nope": 1}', '{"temperature": NaN}'):  # fmt: skip
        with pytest.raises(ValueError):
            EngineRequestParams.from_bytes(bad.encode())


def test_malformed_json_quotes_position() -> None:
    msg = rejected('{"max_tokens": 5,, }')
    assert "not valid JSON" in msg and "line 1 column 18 (char 17)" in msg
    assert "max_tokens, temperature" in msg


@pytest.mark.parametrize(
    ("raw", "why"),
    [("[" * 100_000, "nested too deep"), ('{"seed": ' + "1" * 5000 + "}", "4300 digits")],
    ids=["deep", "bigint"],
)
def test_json_past_the_parsers_limits_is_invalid_not_internal(raw: str, why: str) -> None:
    """The parser raises RecursionError and ValueError there, not JSONDecodeError: they were INTERNAL
    errors with a Python traceback's words."""
    msg = rejected(raw)
    assert "not valid JSON" in msg and why in msg and "max_tokens, temperature" in msg


@pytest.mark.parametrize(
    ("raw", "kind"), [("[1, 2]", "array"), ('"x"', "string"), ("3", "number"), ("null", "null")]
)
def test_non_object_rejected(raw: str, kind: str) -> None:
    msg = rejected(raw)
    assert f"must be a JSON object, got a JSON {kind}" in msg and "allowed keys" in msg


def test_unknown_keys_listed_with_allowed() -> None:
    msg = rejected('{"max_token": 5, "beam_width": 2}')
    assert msg == (
        "unknown sampling_parameters key(s): 'max_token', 'beam_width'; "
        "allowed keys: max_tokens, temperature, top_p, top_k, seed, stop, ignore_eos"
    )


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        ('{"max_tokens": 0}', "max_tokens must be an integer 1..64, got 0"),
        ('{"max_tokens": 65}', "max_tokens must be an integer 1..64, got 65"),
        ('{"max_tokens": true}', "max_tokens must be an integer 1..64, got true"),
        ('{"max_tokens": 5.5}', "max_tokens must be an integer 1..64, got 5.5"),
        ('{"max_tokens": "5"}', 'max_tokens must be an integer 1..64, got "5"'),
        ('{"temperature": -0.1}', "temperature must be a number in [0, 2] (0 = greedy), got -0.1"),
        ('{"temperature": 2.5}', "temperature must be a number in [0, 2]"),
        ('{"temperature": false}', "temperature must be a number in [0, 2]"),
        ('{"top_p": 0}', "top_p must be a number in (0, 1], got 0"),
        ('{"top_p": 1.01}', "top_p must be a number in (0, 1]"),
        ('{"top_k": -1}', "top_k must be an integer >= 0, got -1"),
        ('{"top_k": 1.0}', "top_k must be an integer >= 0"),
        ('{"seed": -1}', "seed must be null or an integer 0..2**63-1, got -1"),
        ('{"seed": 9223372036854775808}', "seed must be null or an integer 0..2**63-1"),
        ('{"seed": true}', "seed must be null or an integer"),
        ('{"stop": ""}', 'stop entry "" is invalid'),
        ('{"stop": ["a", 3]}', "stop entry 3 is invalid"),
        ('{"stop": {"a": 1}}', "stop must be a string or a list of at most 8 non-empty strings"),
        (json.dumps({"stop": ["x"] * 9}), "stop has 9 entries; allowed: a string or a list of at most 8"),
        (json.dumps({"stop": ["x" * 65]}), "of at most 64 characters"),
        ('{"stop": ["ok", null]}', "stop entry null is invalid"),
        ('{"ignore_eos": 1}', "ignore_eos must be true or false, got 1"),
        ('{"temperature": NaN}', "contains NaN; allowed: finite JSON numbers only"),
        ('{"top_p": Infinity}', "contains Infinity"),
        ('{"top_k": 1, "top_k": 2}', "duplicate key 'top_k'"),
        (b'{"stop": "\xff"}', "sampling_parameters is not valid UTF-8 (byte 0xff at offset 10)"),
    ],
)
def test_bad_values_explained(raw: str | bytes, needle: str) -> None:
    assert needle in rejected(raw)


def test_boundary_values_accepted() -> None:
    out = parse_sampling_parameters(
        json.dumps({"max_tokens": 1, "temperature": 2, "top_p": 1e-9, "top_k": 0, "seed": 0,
                    "stop": ["x" * 64] * 8}), LIMITS)  # fmt: skip
    assert out["max_tokens"] == 1 and out["seed"] == 0 and len(out["stop"]) == 8
    assert parse_sampling_parameters('{"max_tokens": 64}', LIMITS)["max_tokens"] == 64


def test_huge_integer_temperature_rejected_not_crashing() -> None:
    assert "temperature must be a number" in rejected('{"temperature": ' + "9" * 400 + "}")


@pytest.mark.parametrize("text", ["", "   ", "\n\t ", b"", b"  \n"])
def test_empty_prompt_rejected(text: str | bytes) -> None:
    with pytest.raises(RequestError, match="text_input is empty or whitespace-only; send a prompt"):
        build(text)


def test_missing_prompt_rejected() -> None:
    with pytest.raises(RequestError, match="text_input is required"):
        build(None)  # type: ignore[arg-type]


def test_prompt_must_be_utf8() -> None:
    with pytest.raises(RequestError, match=r"text_input is not valid UTF-8 \(byte 0xc3 at offset 2\)"):
        build(b"ab\xc3(")
    assert build("héllo 漢字 🙂".encode()).max_tokens == 16


def test_prompt_too_long_says_count_and_limit() -> None:
    build(prompt_token_count=100)
    with pytest.raises(RequestError) as info:
        build(prompt_token_count=101)
    assert str(info.value) == "prompt has 101 tokens; allowed: at most 100 tokens"


def test_unknown_tier() -> None:
    with pytest.raises(RequestError) as info:
        build(tier="gold")
    assert str(info.value) == "unknown slo_tier 'gold'; allowed: critical, warmup, standard, batch"
    assert build(tier="").tier == "standard"
    assert build(tier=b"batch").tier == "batch"


@pytest.mark.parametrize("tenant", ["a", "A-b_c.9", "x" * 64, b"acme"])
def test_valid_tenants(tenant: str | bytes) -> None:
    expected = tenant.decode() if isinstance(tenant, bytes) else tenant
    assert build(tenant=tenant).tenant == expected


@pytest.mark.parametrize("tenant", ["x" * 65, "a b", "a/b", "ä", "a:b", "../x"])
def test_invalid_tenants(tenant: str) -> None:
    with pytest.raises(RequestError) as info:
        build(tenant=tenant)
    assert "allowed: 1..64 characters from [A-Za-z0-9_.-]" in str(info.value)


def test_absent_tenant_is_default() -> None:
    assert build(tenant=None).tenant == "default"
    assert build(tenant="").tenant == "default"


@pytest.mark.parametrize(
    ("cache", "mode", "kv_tiers", "reads", "writes"),
    [(None, "use", True, True, True), ("", "use", True, True, True), ("use", "use", True, True, True),
     (b"bypass", "bypass", False, False, False), ("kv-only", "kv-only", True, False, False),
     (b"kv-only", "kv-only", True, False, False), ("refresh", "refresh", True, False, True)],
)  # fmt: skip
def test_cache_modes(cache: str | bytes | None, mode: str, kv_tiers: bool, reads: bool, writes: bool) -> None:
    params = build(cache=cache)
    assert (params.cache, params.uses_kv_tiers) == (mode, kv_tiers)
    assert (params.reads_response_cache, params.writes_response_cache) == (reads, writes)
    assert EngineRequestParams.from_bytes(params.to_bytes()) == params


@pytest.mark.parametrize("cache", ["off", "BYPASS", "no", "kv_only", "kv"])
def test_unknown_cache_mode(cache: str) -> None:
    with pytest.raises(RequestError) as info:
        build(cache=cache)
    assert info.value.code == "INVALID_ARG"
    assert str(info.value) == f"invalid cache {cache!r}; allowed: use, bypass, kv-only, refresh (default use)"


def test_engine_message_with_an_unknown_cache_mode_is_refused() -> None:
    data = build(cache="kv-only").to_bytes().replace(b'"kv-only"', b'"kv"')
    with pytest.raises(ValueError, match="cache must be one of"):
        EngineRequestParams.from_bytes(data)


def test_stream_flags() -> None:
    assert build(stream=False).stream is False
    assert build(stream=True, exclude_input_in_output=False).stream is True
    assert build(exclude_input_in_output=True).exclude_input_in_output is True


def test_limits_validated() -> None:
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1"):
        Limits(max_prompt_tokens=10, max_new_tokens=0)
