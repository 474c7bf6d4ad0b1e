"""Validation of client input into a normalized `EngineRequestParams`.

Everything a client can get wrong is checked here, before the request reaches the engine, so a bad
request costs no GPU time and the error says both what was wrong and what is allowed.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from scheduler.errors import RequestError
from scheduler.messages import CACHE_MODES, EngineRequestParams, is_int
from scheduler.sampling_rules import SAMPLING_KEYS, check_sampling
from scheduler.tiers import TierTable

DEFAULT_TENANT = "default"
TENANT_PATTERN = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
TENANT_RULE = "1..64 characters from [A-Za-z0-9_.-]"


@dataclass(frozen=True)
class Limits:
    """Per-deployment bounds on request size (they bound KV memory and latency per request)."""

    max_prompt_tokens: int
    max_new_tokens: int
    default_max_tokens: int = 16
    # characters past which a prompt cannot fit max_prompt_tokens (scheduler/tokenize.py
    # `max_prompt_chars`): refused before it is tokenized; None: every prompt is tokenized
    max_prompt_chars: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_prompt_tokens", "max_new_tokens", "default_max_tokens"):
            value = getattr(self, name)
            if not (is_int(value) and value >= 1):
                raise ValueError(f"Limits.{name} must be an int >= 1, got {value!r}")
        chars = self.max_prompt_chars
        if chars is not None and not (is_int(chars) and chars >= 1):
            raise ValueError(f"Limits.max_prompt_chars must be an int >= 1 or None, got {chars!r}")

    @property
    def effective_default_max_tokens(self) -> int:
        """The default never exceeds the deployment's cap, so omitting max_tokens is always valid."""
        return min(self.default_max_tokens, self.max_new_tokens)


def _invalid(message: str) -> RequestError:
    return RequestError.invalid(message)


def _decode_utf8(raw: bytes, what: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _invalid(
            f"{what} is not valid UTF-8 (byte 0x{raw[exc.start]:02x} at offset {exc.start}); "
            "send UTF-8 encoded text"
        ) from None


def _reject_constant(name: str) -> Any:
    raise _invalid(f"sampling_parameters contains {name}; allowed: finite JSON numbers only")


def _object_without_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _invalid(f"sampling_parameters has duplicate key {key!r}; each key may appear once")
        out[key] = value
    return out


def _load_json_object(raw: str | bytes) -> dict[str, Any]:
    text = _decode_utf8(raw, "sampling_parameters") if isinstance(raw, bytes) else raw
    if not text.strip():
        return {}
    try:
        value = json.loads(
            text, parse_constant=_reject_constant, object_pairs_hook=_object_without_duplicates
        )
    except json.JSONDecodeError as exc:
        raise _invalid(
            f"sampling_parameters is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno} "
            f"(char {exc.pos}); expected a JSON object with keys from: {', '.join(SAMPLING_KEYS)}"
        ) from None
    except (RecursionError, ValueError) as exc:  # nested past the parser's depth; a 5000-digit integer
        why = "nested too deep" if isinstance(exc, RecursionError) else str(exc).split(";")[0]
        raise _invalid(
            f"sampling_parameters is not valid JSON: {why}; "
            f"expected a JSON object with keys from: {', '.join(SAMPLING_KEYS)}"
        ) from None
    if not isinstance(value, dict):
        raise _invalid(
            f"sampling_parameters must be a JSON object, got a JSON {_json_type(value)}; "
            f"allowed keys: {', '.join(SAMPLING_KEYS)}"
        )
    return value


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def parse_sampling_parameters(raw: str | bytes | None, limits: Limits) -> dict[str, Any]:
    """Parse the `sampling_parameters` JSON into the sampling fields of `EngineRequestParams`.

    Missing keys get their defaults, so the result always has every key in `SAMPLING_KEYS`.
    """
    given = {} if raw is None else _load_json_object(raw)
    unknown = [k for k in given if k not in SAMPLING_KEYS]
    if unknown:
        raise _invalid(
            f"unknown sampling_parameters key(s): {', '.join(map(repr, unknown))}; "
            f"allowed keys: {', '.join(SAMPLING_KEYS)}"
        )
    out: dict[str, Any] = {
        "max_tokens": limits.effective_default_max_tokens,
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": 0,
        "seed": None,
        "stop": (),
        "ignore_eos": False,
    }
    out.update(check_sampling(given, limits.max_new_tokens, "sampling_parameters"))
    return out


def validate_prompt(text: str | bytes | None) -> str:
    """Decode and check the prompt before tokenization; returns it unchanged (no stripping)."""
    if text is None:
        raise _invalid("text_input is required; send a non-empty UTF-8 prompt")
    prompt = _decode_utf8(text, "text_input") if isinstance(text, bytes) else text
    if not isinstance(prompt, str):
        raise _invalid(f"text_input must be text, got {type(prompt).__name__}; send a non-empty UTF-8 prompt")
    if not prompt.strip():
        raise _invalid(
            "text_input is empty or whitespace-only; send a prompt with at least one visible character"
        )
    return prompt


PROMPT_TOO_LONG = "tokens; allowed: at most"  # in the error below; clients that adapt their prompts match it


def validate_prompt_length(prompt_token_count: int, limits: Limits) -> None:
    """Reject prompts longer than the deployment allows (they would not fit the KV budget)."""
    if prompt_token_count > limits.max_prompt_tokens:
        raise _invalid(f"prompt has {prompt_token_count} {PROMPT_TOO_LONG} {limits.max_prompt_tokens} tokens")


def validate_prompt_size(prompt: str, limits: Limits) -> None:
    """Reject, before tokenizing it, a prompt with more characters than `max_prompt_tokens` can cover:
    the step has one instance, and every other request would wait while it tokenizes megabytes."""
    if limits.max_prompt_chars is not None and len(prompt) > limits.max_prompt_chars:
        raise _invalid(
            f"prompt has more than {limits.max_prompt_tokens} {PROMPT_TOO_LONG} {limits.max_prompt_tokens} "
            f"tokens (its {len(prompt)} characters cannot fit: at most {limits.max_prompt_chars} can)"
        )


def validate_tenant(tenant: str | bytes | None) -> str:
    """Tenants key caches and KV snapshots, so they are restricted to a safe, short alphabet."""
    if tenant is None:
        return DEFAULT_TENANT
    name = _decode_utf8(tenant, "tenant") if isinstance(tenant, bytes) else tenant
    if name == "":
        return DEFAULT_TENANT
    if not isinstance(name, str) or not TENANT_PATTERN.fullmatch(name):
        raise _invalid(f"invalid tenant {name!r}; allowed: {TENANT_RULE}")
    return name


def validate_cache_mode(cache: str | bytes | None) -> str:
    """One of CACHE_MODES; None or empty is "use". "bypass" keeps a prompt out of every cache (it must
    not persist in Redis); "kv-only" still reuses KV prefixes but always generates a fresh answer; both
    give the benchmark its baselines for what the caches cost on one server. "refresh" generates afresh
    too and keeps the answer (the warmup job's fill of the response caches)."""
    mode = _decode_utf8(cache, "cache") if isinstance(cache, bytes) else cache
    if mode is None or mode == "":
        return "use"
    if mode not in CACHE_MODES:
        raise _invalid(f"invalid cache {mode!r}; allowed: {', '.join(CACHE_MODES)} (default use)")
    return mode


def validate_tier(tier: str | bytes | None, tiers: TierTable) -> str:
    """The tier's name; None or empty selects the table's default tier."""
    name = _decode_utf8(tier, "slo_tier") if isinstance(tier, bytes) else tier
    return tiers.get(name).name


def build_request(
    text: str | bytes | None,
    sampling_json: str | bytes | None,
    stream: bool | None,
    exclude_input_in_output: bool | None,
    tier: str | bytes | None,
    tenant: str | bytes | None,
    *,
    prompt_token_count: int,
    limits: Limits,
    tiers: TierTable,
    now_ns: int,
    cache: str | bytes | None = None,
) -> EngineRequestParams:
    """Validate one request's inputs (as the scheduler step received them) into engine parameters.

    Optional inputs are None when absent. `prompt_token_count` comes from the scheduler's tokenizer.
    """
    validate_prompt(text)
    validate_prompt_length(prompt_token_count, limits)
    sampling = parse_sampling_parameters(sampling_json, limits)
    return EngineRequestParams(
        **sampling,
        stream=bool(stream),
        exclude_input_in_output=bool(exclude_input_in_output),
        tier=validate_tier(tier, tiers),
        tenant=validate_tenant(tenant),
        arrival_ns=int(now_ns),
        cache=validate_cache_mode(cache),
    )
