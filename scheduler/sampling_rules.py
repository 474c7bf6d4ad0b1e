"""The allowed ranges of the sampling parameters, in one place for both steps that enforce them.

The scheduler step checks a client's `sampling_parameters` with `check_sampling`, and the engine checks
the `request_params` it receives with it again: Triton serves `llm_engine` to anyone, and a direct
request skipped every limit (max_tokens past the deployment's cap, megabytes of stop strings scanned on
every token by the thread all tenants share). One function, so the two can never drift apart.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from scheduler.errors import RequestError
from scheduler.messages import MIN_TEMPERATURE, is_int, is_number, utf8_encodable

DEFAULT_MAX_NEW_TOKENS = 512  # LLM_MAX_NEW_TOKENS unset: both steps' config.pbtxt default to it as well
SAMPLING_KEYS: tuple[str, ...] = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos")
MAX_SEED = 2**63 - 1
MAX_STOP_SEQUENCES = 8
MAX_STOP_CHARS = 64
MAX_TEMPERATURE = 2.0
STOP_RULE = (
    f"a string or a list of at most {MAX_STOP_SEQUENCES} non-empty strings "
    f"of at most {MAX_STOP_CHARS} characters"
)


def _show(value: object) -> str:
    """The value as the client wrote it (JSON), so `true` and `"5"` read as sent; escaped where UTF-8
    cannot carry it (a lone surrogate), since the message goes back to the client as UTF-8."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except RecursionError:  # nested just short of the parser's limit: it parsed, but cannot be written back
        return f"a JSON {'array' if isinstance(value, (list, tuple)) else 'object'} nested too deep"
    except (TypeError, ValueError):
        text = repr(value)
    return text if utf8_encodable(text) else text.encode("utf-8", "backslashreplace").decode("utf-8")


def _int_in(name: str, value: Any, low: int, high: int | None) -> int:
    if not is_int(value) or value < low or (high is not None and value > high):
        bound = f"{low}..{high}" if high is not None else f">= {low}"
        raise RequestError.invalid(f"{name} must be an integer {bound}, got {_show(value)}")
    return int(value)


def _temperature(name: str, value: Any) -> float:
    if not is_number(value) or not 0.0 <= value <= MAX_TEMPERATURE:
        raise RequestError.invalid(
            f"{name} must be a number in [0, {MAX_TEMPERATURE:g}] (0 = greedy), got {_show(value)}"
        )
    return float(value) if value >= MIN_TEMPERATURE else 0.0  # greedy: see MIN_TEMPERATURE


def _top_p(name: str, value: Any) -> float:
    if not is_number(value) or not 0.0 < value <= 1.0:
        raise RequestError.invalid(f"{name} must be a number in (0, 1], got {_show(value)}")
    return float(value)


def _seed(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if not is_int(value) or not 0 <= value <= MAX_SEED:
        raise RequestError.invalid(f"{name} must be null or an integer 0..2**63-1, got {_show(value)}")
    return int(value)


def _stop(name: str, value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)):  # a tuple: the engine's parsed request_params
        raise RequestError.invalid(f"{name} must be {STOP_RULE}, got {_show(value)}")
    if len(items) > MAX_STOP_SEQUENCES:
        raise RequestError.invalid(f"{name} has {len(items)} entries; allowed: {STOP_RULE}")
    for item in items:
        if not isinstance(item, str) or not item or len(item) > MAX_STOP_CHARS:
            raise RequestError.invalid(f"{name} entry {_show(item)} is invalid; allowed: {STOP_RULE}")
        # matched as UTF-8 bytes and hashed into cache keys: a lone surrogate would raise there
        if not utf8_encodable(item):
            raise RequestError.invalid(
                f"{name} entry {json.dumps(item)} is not Unicode text (a lone surrogate escape)"
            )  # json.dumps escapes it: the message itself must encode
    return tuple(items)


def _ignore_eos(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise RequestError.invalid(f"{name} must be true or false, got {_show(value)}")
    return value


def check_sampling(given: Mapping[str, object], max_new_tokens: int, where: str) -> dict[str, Any]:
    """The `SAMPLING_KEYS` present in `given`, checked and normalized (a temperature below
    MIN_TEMPERATURE is 0, a single stop string a tuple of one); other keys are the caller's. The first
    value out of range raises RequestError (INVALID_ARG) naming it as `<where>.<key>` and what is allowed."""
    checks = {
        "max_tokens": lambda name, value: _int_in(name, value, 1, max_new_tokens),
        "temperature": _temperature,
        "top_p": _top_p,
        "top_k": lambda name, value: _int_in(name, value, 0, None),
        "seed": _seed,
        "stop": _stop,
        "ignore_eos": _ignore_eos,
    }
    return {key: checks[key](f"{where}.{key}", given[key]) for key in SAMPLING_KEYS if key in given}
