"""What the engine receives per request and how it answers, independent of Triton."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from scheduler.messages import EngineRequestParams

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
    scheduling_ns: int = 0  # time spent deciding about it: admission, queueing, dispatch, preemption
    prefix_hint: PrefixHint | None = None  # its prefix keys and L3 probe, started on arrival
    response_key: ResponseKey | None = None  # its exact response-cache key, from its lookup on arrival
