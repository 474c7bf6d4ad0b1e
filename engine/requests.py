"""What the engine receives per request and how it answers, independent of Triton."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from scheduler.errors import RequestError
from scheduler.messages import EngineRequestParams, utf8_encodable
from scheduler.sampling_rules import SAMPLING_KEYS, check_sampling
from scheduler.validation import TENANT_RULE, validate_tenant

if TYPE_CHECKING:
    from engine.prefix_cache import PrefixHint
    from engine.response_tier import ResponseKey


class ResponseSink(Protocol):
    """Where a request's output goes; the Triton adapter wraps a decoupled response sender."""

    def send(self, token_ids: list[int], read_offset: int, final: bool, trim_bytes: int) -> None:
        """Tokens `token_ids[read_offset:]` are new; the ones before are context for detokenizing.

        `trim_bytes` (final responses only) cuts the text where a stop string began inside a token.
        """

    def fail(self, code: str, message: str) -> None:
        """End the request with an error (INVALID_ARG, UNAVAILABLE or INTERNAL)."""

    def cancelled(self) -> bool:
        """True once the client has cancelled the request."""


@dataclass
class EngineRequest:
    request_id: str
    prompt_ids: list[int]
    params: EngineRequestParams
    priority: int
    deadline_ns: int
    sink: ResponseSink
    received_ns: int = 0
    # when it arrived (wall clock), as the engine believes it: the scheduler step's params.arrival_ns, but
    # no earlier than MAX_HOP_NS before receipt and no later than receipt (set by Engine.submit)
    arrival_ns: int = 0
    scheduling_ns: int = 0  # time spent deciding about it: admission, queueing, dispatch, preemption
    prefix_hint: PrefixHint | None = None  # its prefix keys and L3 probe, started on arrival
    response_key: ResponseKey | None = None  # its exact response-cache key, from its lookup on arrival

    @property
    def arrived_ns(self) -> int:
        """Its bounded arrival, or its receipt where nothing set one (a request queued without submit)."""
        return self.arrival_ns or self.received_ns


def check_params(params: EngineRequestParams, max_new_tokens: int) -> None:
    """RequestError (INVALID_ARG) for parameters the scheduler step would have refused, by its own rules:
    Triton serves llm_engine to anyone, and a direct request was held to none of the step's limits
    (max_tokens past the cap, top_p 0 failing as INTERNAL, stop strings of any number and length), nor
    to a response_key UTF-8 can write: JSON's "\\ud800" escape under the exact cache's namespace raised
    UnicodeEncodeError from the Redis GET, answered INTERNAL."""
    check_sampling({key: getattr(params, key) for key in SAMPLING_KEYS}, max_new_tokens, "request_params")
    if not utf8_encodable(params.response_key):
        raise RequestError.invalid(
            f"request_params.response_key {params.response_key[:60]!r} is not Unicode text (a lone "
            'surrogate escape); allowed: the scheduler step\'s key, or ""'
        )
    if validate_tenant(params.tenant) != params.tenant:  # "": the step sends "default" instead
        raise RequestError.invalid(f"invalid tenant {params.tenant!r}; allowed: {TENANT_RULE}")
