"""The one error type that pure scheduling/validation logic raises.

Model adapters map `code` to `pb_utils.TritonError` codes, so the logic stays free of Triton imports
while the client still gets a precise status and a message saying what was wrong and what is allowed.
"""

from __future__ import annotations

from typing import Literal

ErrorCode = Literal["INVALID_ARG", "UNAVAILABLE", "INTERNAL"]
ERROR_CODES: tuple[ErrorCode, ...] = ("INVALID_ARG", "UNAVAILABLE", "INTERNAL")
# A gRPC stream carries an error's text without its status code: an UNAVAILABLE error (overload,
# shedding, a queue full, a drain or a stop: retry later or elsewhere) leaves the server with this in
# front of its text (adapters/triton_common.py), which is how a client tells a refusal from a failure
# (client/load.py `is_rejection`), whatever else either text says.
UNAVAILABLE_PREFIX = "UNAVAILABLE: "


class RequestError(Exception):
    """A request failure with a Triton-style status code and a self-explaining message."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        if code not in ERROR_CODES:
            raise ValueError(f"unknown error code {code!r}; allowed: {', '.join(ERROR_CODES)}")
        super().__init__(message)
        self.code: ErrorCode = code
        self.message = message

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        return f"RequestError({self.code!r}, {self.message!r})"

    @classmethod
    def invalid(cls, message: str) -> RequestError:
        """Bad input from the client (INVALID_ARG)."""
        return cls("INVALID_ARG", message)

    @classmethod
    def unavailable(cls, message: str) -> RequestError:
        """Overload or shedding; the client may retry later (UNAVAILABLE)."""
        return cls("UNAVAILABLE", message)

    @classmethod
    def internal(cls, message: str) -> RequestError:
        """A bug or broken invariant on our side (INTERNAL)."""
        return cls("INTERNAL", message)
