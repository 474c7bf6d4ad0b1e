"""Helpers every Python-backend model uses: parameters, errors, structured logs.

Imported only inside the Triton stub, where `triton_python_backend_utils` exists.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import triton_python_backend_utils as pb_utils

from engine.config import expand_env, triton_warmup_requests
from engine.gc_settle import settle_garbage_collector
from scheduler.errors import UNAVAILABLE_PREFIX, RequestError


def model_parameters(args: dict) -> dict[str, str]:
    """Model-config parameters as plain strings (Triton's convention), `${VAR:-default}` expanded."""
    config = json.loads(args["model_config"])
    return {key: expand_env(value["string_value"]) for key, value in config.get("parameters", {}).items()}


def triton_error(code: str, message: str) -> pb_utils.TritonError:
    """`code` is a RequestError code or CANCELLED; TritonError's codes exist only once the stub runs.
    An UNAVAILABLE error's text starts with UNAVAILABLE_PREFIX: a stream client gets no code to go by."""
    error = pb_utils.TritonError
    if code == "UNAVAILABLE":
        message = UNAVAILABLE_PREFIX + message
    return error(message, getattr(error, code, error.INTERNAL))


def error_response(exc: Exception) -> pb_utils.InferenceResponse:
    if isinstance(exc, RequestError):
        return pb_utils.InferenceResponse(error=triton_error(exc.code, exc.message))
    return pb_utils.InferenceResponse(error=triton_error("INTERNAL", f"{type(exc).__name__}: {exc}"))


def log_event(event: str, log: Callable[[str], None] | None = None, **fields) -> None:
    """One JSON object per line, so log shippers can parse it; `log`: the process's logger where other
    threads send messages too (adapters/stub_messages.py: serialized), else pb_utils.Logger.log_info."""
    (log or pb_utils.Logger.log_info)(
        json.dumps({"event": event, **fields}, default=str, separators=(",", ":"))
    )


def request_parameters(request) -> dict:
    """Triton request parameters (e.g. slo_tier, tenant), {} when absent or unreadable."""
    try:
        raw = request.parameters()
        return json.loads(raw) if raw else {}
    except (ValueError, AttributeError):
        return {}


def warm_handler(handler, model_name: str, inputs: dict, rounds: int = 3) -> float:
    """Run a model's own request handler on local requests before READY; returns the seconds spent.

    The first execute of a Python model pays for lazy imports, the tokenizer's first call and the
    first tensor conversions (16-20 ms per text step measured on the CPU); paying it here keeps it
    out of the first user's TTFT. BLS cannot run in initialize(), but a locally built
    InferenceRequest goes through the same handler code without leaving the process. The handler
    is called with `local=True`: such a request has no server-side state (asking it whether it
    was cancelled aborts the stub).
    """
    import time

    request = pb_utils.InferenceRequest(
        model_name=model_name,
        inputs=[pb_utils.Tensor(name, value) for name, value in inputs.items()],
        requested_output_names=[],
    )
    started = time.perf_counter()
    for _ in range(rounds):
        response = handler(request, local=True)
        if response.has_error():
            raise RuntimeError(f"self-warmup of {model_name} failed: {response.error().message()}")
    settle_garbage_collector()
    return time.perf_counter() - started


class TritonWarmupSamples:
    """Triton's `model_warmup` samples arrive after initialize() and before READY, so nothing else can
    reach the model first: its first requests are them, the model's own (no tenant token needed)."""

    def __init__(self, model_config: dict):
        self.left = triton_warmup_requests(model_config)

    def next_is_own(self) -> bool:
        """Whether the request now arriving is one of the samples."""
        own, self.left = self.left > 0, max(0, self.left - 1)
        return own
