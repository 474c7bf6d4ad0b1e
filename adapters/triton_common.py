"""Helpers every Python-backend model uses: parameters, errors, structured logs.

Imported only inside the Triton stub, where `triton_python_backend_utils` exists.
"""

from __future__ import annotations

import json

import triton_python_backend_utils as pb_utils

from engine.config import expand_env
from scheduler.errors import RequestError



def model_parameters(args: dict) -> dict[str, str]:
    """Model-config parameters as plain strings (Triton's convention), `${VAR:-default}` expanded."""
    config = json.loads(args["model_config"])
    return {key: expand_env(value["string_value"]) for key, value in config.get("parameters", {}).items()}


def triton_error(code: str, message: str) -> pb_utils.TritonError:
    """`code` is a RequestError code or CANCELLED; TritonError's codes exist only once the stub runs."""
    error = pb_utils.TritonError
    return error(message, getattr(error, code, error.INTERNAL))


def error_response(exc: Exception) -> pb_utils.InferenceResponse:
    if isinstance(exc, RequestError):
        return pb_utils.InferenceResponse(error=triton_error(exc.code, exc.message))
    return pb_utils.InferenceResponse(error=triton_error("INTERNAL", f"{type(exc).__name__}: {exc}"))


def log_event(event: str, **fields) -> None:
    """One JSON object per line, so log shippers can parse it."""
    pb_utils.Logger.log_info(json.dumps({"event": event, **fields}, default=str, separators=(",", ":")))


def request_parameters(request) -> dict:
    """Triton request parameters (e.g. slo_tier, tenant), {} when absent or unreadable."""
    try:
        raw = request.parameters()
        return json.loads(raw) if raw else {}
    except (ValueError, AttributeError):
        return {}
