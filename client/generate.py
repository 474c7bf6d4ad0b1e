"""Generation over Triton's gRPC bi-directional stream (tritonclient.grpc).

The `llm` ensemble is decoupled: a request gets any number of `text_output` pieces and then a response
flagged `triton_final_response` (requested with `enable_empty_final_response=True`), so the client knows
when a request ended even when the last piece is empty.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from scheduler.tenant_auth import token_from_env
from scheduler.tiers import TierTable

FINAL_PARAM = "triton_final_response"
OUTPUT_NAME = "text_output"
PieceCallback = Callable[[str], None]


_DEFAULT_TIERS = TierTable.defaults()


def tier_priority(tier: str | None) -> int:
    """Triton request priority for a tier (1 = highest), so the scheduler step's own queue, which
    declares priority_levels, serves higher tiers first under overload; 0 = the model's default."""
    if not tier or tier not in _DEFAULT_TIERS:
        return 0
    return _DEFAULT_TIERS.get(tier).priority


class GenerationError(RuntimeError):
    """The server (or the stream) failed the request; the message is the server's, unchanged."""


@dataclass(frozen=True)
class GenerationResult:
    """One finished request. `ttft_s` is None when no non-empty piece arrived. `first_token_s`: when
    the first token's response arrived, text or not (a token that ends inside a UTF-8 character is held
    back by the detokenizer: its piece is empty, and the text waits for the next token)."""

    text: str
    pieces: list[str]
    ttft_s: float | None
    total_s: float
    error: str | None = None
    request_id: str = ""
    first_token_s: float | None = None
    finished: bool = True  # a final response or an error came (False: read while still open)


def input_arrays(
    prompt: str,
    *,
    sampling: Mapping[str, Any] | None = None,
    stream: bool = True,
    exclude_input_in_output: bool | None = None,
    tier: str | None = None,
    tenant: str | None = None,
    cache: str | None = None,
    tenant_token: str | None = None,
) -> dict[str, np.ndarray]:
    """The request tensors by name; optional inputs only when given, so server defaults apply. A named
    tenant's token, when not given, is made from LLM_TENANT_SECRET if this process has it (the
    operator's tools: warmup job, load generator, launcher)."""
    arrays: dict[str, np.ndarray] = {
        "text_input": np.array([prompt.encode("utf-8")], dtype=np.object_),
        "stream": np.array([bool(stream)], dtype=np.bool_),
    }
    if sampling is not None:
        text = json.dumps(dict(sampling))
        arrays["sampling_parameters"] = np.array([text.encode("utf-8")], dtype=np.object_)
    if exclude_input_in_output is not None:
        arrays["exclude_input_in_output"] = np.array([bool(exclude_input_in_output)], dtype=np.bool_)
    if tier is not None:
        arrays["slo_tier"] = np.array([tier.encode("utf-8")], dtype=np.object_)
    if tenant is not None:
        arrays["tenant"] = np.array([tenant.encode("utf-8")], dtype=np.object_)
    token = token_from_env(tenant) if tenant_token is None else tenant_token  # "": send none
    if token:
        arrays["tenant_token"] = np.array([token.encode("utf-8")], dtype=np.object_)
    if cache is not None:  # "use" (default), "kv-only" (no response cache), "refresh" or "bypass"
        arrays["cache"] = np.array([cache.encode("utf-8")], dtype=np.object_)
    return arrays


def build_inputs(prompt: str, **options: Any) -> list[grpcclient.InferInput]:
    """`input_arrays` as tritonclient InferInputs (BYTES for object arrays, BOOL for flags)."""
    inputs = []
    for name, array in input_arrays(prompt, **options).items():
        datatype = "BYTES" if array.dtype == np.object_ else "BOOL"
        tensor = grpcclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def is_final(result: grpcclient.InferResult) -> bool:
    params = result.get_response().parameters
    return FINAL_PARAM in params and params[FINAL_PARAM].bool_param


def pieces_of(result: grpcclient.InferResult) -> list[str]:
    """Text pieces in one response; the empty final response has no output at all."""
    response = result.get_response()
    if not any(out.name == OUTPUT_NAME for out in response.outputs):
        return []
    array = result.as_numpy(OUTPUT_NAME)
    if array is None:
        return []
    return [_text(v) for v in array.reshape(-1)]


def _text(value: object) -> str:
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)


@dataclass
class _Pending:
    """Mutable progress of one in-flight request; owned by its session and guarded by its lock."""

    request_id: str
    sent_s: float
    on_piece: PieceCallback | None
    pieces: list[str] = field(default_factory=list)
    first_piece_s: float | None = None
    first_response_s: float | None = None  # the first response with output, empty piece or not
    done_s: float | None = None
    error: str | None = None

    def result(self, now_s: float) -> GenerationResult:
        end = self.done_s if self.done_s is not None else now_s
        ttft = None if self.first_piece_s is None else self.first_piece_s - self.sent_s
        first_token = None if self.first_response_s is None else self.first_response_s - self.sent_s
        return GenerationResult(
            "".join(self.pieces),
            list(self.pieces),
            ttft,
            end - self.sent_s,
            self.error,
            self.request_id,
            first_token,
            self.done_s is not None,
        )


class StreamingSession:
    """Several concurrent requests on one gRPC stream, each with its own request id and result.

    Triton reports a per-request error on the stream without the request id (tritonclient drops it), so
    an error is matched to a request only when it is unambiguous: when as many errors are unmatched as
    requests are unfinished, those requests failed, in the order they were sent. Stream-level failures
    (cancellation, connection loss) fail every unfinished request.
    """

    def __init__(self, url: str, *, model: str = "llm", stream_timeout_s: float | None = None) -> None:
        self.url = url
        self.model = model
        self._client = grpcclient.InferenceServerClient(url=url)
        self._lock = threading.Condition()
        self._pending: dict[str, _Pending] = {}
        self._order: list[str] = []
        self._unmatched_errors: list[str] = []
        self._stream_error: str | None = None
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]
        self._closed = False
        self._client.start_stream(callback=self._on_response, stream_timeout=stream_timeout_s)

    def __enter__(self) -> StreamingSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def submit(
        self,
        prompt: str,
        *,
        sampling: Mapping[str, Any] | None = None,
        stream: bool = True,
        exclude_input_in_output: bool | None = None,
        tier: str | None = None,
        tenant: str | None = None,
        cache: str | None = None,
        on_piece: PieceCallback | None = None,
        request_id: str | None = None,
        triton_priority: bool = True,
        tenant_token: str | None = None,
    ) -> str:
        """Send one request without waiting; returns its request id.

        `triton_priority` puts the tier's priority on the request for Triton's own queues (False: the
        model's default priority, e.g. for a baseline that must not get precedence from Triton).
        """
        inputs = build_inputs(
            prompt, sampling=sampling, stream=stream, exclude_input_in_output=exclude_input_in_output,
            tier=tier, tenant=tenant, cache=cache, tenant_token=tenant_token,
        )  # fmt: skip
        rid = request_id or f"{self._prefix}-{next(self._ids)}"
        with self._lock:
            if self._closed:
                raise GenerationError("the streaming session is closed; open a new StreamingSession")
            if rid in self._pending:
                raise ValueError(f"request id {rid!r} is already used in this session; ids must be unique")
            self._pending[rid] = _Pending(rid, time.perf_counter(), on_piece)
            self._order.append(rid)
        try:
            self._client.async_stream_infer(
                self.model,
                inputs,
                request_id=rid,
                enable_empty_final_response=True,
                priority=tier_priority(tier) if triton_priority else 0,
            )
        except InferenceServerException as exc:
            self._finish(rid, self._explain_stream_error() or str(exc))
        return rid

    def _explain_stream_error(self, wait_s: float = 1.0) -> str | None:
        """tritonclient refuses a send once the stream broke and reports why only to the callback,
        which runs just after; wait briefly for that reason (e.g. the server is unreachable)."""
        with self._lock:
            self._lock.wait_for(lambda: self._stream_error is not None, wait_s)
            return self._stream_error

    def wait(self, request_ids: Iterable[str] | None = None, timeout_s: float | None = None) -> bool:
        """Block until the given requests (default: all) finished; False on timeout."""
        ids = list(request_ids) if request_ids is not None else None
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._lock:
            while True:
                waiting = [p for p in self._pending.values() if (ids is None or p.request_id in ids)]
                if all(p.done_s is not None for p in waiting):
                    return True
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._lock.wait(remaining)

    def result(self, request_id: str) -> GenerationResult:
        """The request's result so far (complete once `wait` returned True for it)."""
        with self._lock:
            return self._pending[request_id].result(time.perf_counter())

    def results(self) -> dict[str, GenerationResult]:
        """Every request's result so far, in the order the requests were sent."""
        with self._lock:
            now = time.perf_counter()
            return {rid: self._pending[rid].result(now) for rid in self._order}

    def unfinished(self) -> list[str]:
        with self._lock:
            return [rid for rid in self._order if self._pending[rid].done_s is None]

    def cancel(self) -> None:
        """Cancel every in-flight request (stop_stream(cancel_requests=True)); the stream is closed."""
        self._fail_unfinished("cancelled by the client")
        self._stop(cancel=True)

    def close(self) -> None:
        """Close the stream; requests still in flight are cancelled (call `wait` first to finish them)."""
        cancel = bool(self.unfinished())
        self._fail_unfinished("the session was closed before the request finished; it was cancelled")
        self._stop(cancel=cancel)
        self._client.close()

    def _stop(self, cancel: bool) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._client.stop_stream(cancel_requests=cancel)

    def _fail_unfinished(self, message: str) -> None:
        for rid in self.unfinished():
            self._finish(rid, message)

    def _finish(self, rid: str, error: str | None) -> None:
        with self._lock:
            pending = self._pending[rid]
            if pending.done_s is None:
                pending.done_s = time.perf_counter()
                pending.error = error
            self._match_errors()
            self._lock.notify_all()

    def _on_response(
        self, result: grpcclient.InferResult | None, error: InferenceServerException | None
    ) -> None:
        """Stream callback on tritonclient's response thread; an exception escaping it would end that
        thread and silently stall every request on the stream, so none may escape."""
        try:
            if error is not None:
                self._on_error(error)
            elif result is not None:
                self._on_result(result)
        except Exception as exc:  # noqa: BLE001 - see docstring
            rid = result.get_response().id if result is not None else None
            if rid in self._pending:
                self._finish(rid, f"client failed to handle a response: {exc!r}")

    def _on_result(self, result: grpcclient.InferResult) -> None:
        rid = result.get_response().id
        now = time.perf_counter()
        pieces = pieces_of(result)
        with self._lock:
            pending = self._pending.get(rid)
            if pending is None or pending.done_s is not None:
                return
            if pieces and pending.first_response_s is None:
                pending.first_response_s = now
            for piece in pieces:
                pending.pieces.append(piece)
                if piece and pending.first_piece_s is None:
                    pending.first_piece_s = now
            callback = pending.on_piece
        if callback is not None:
            for piece in pieces:
                if piece:
                    callback(piece)
        if is_final(result):
            self._finish(rid, None)

    def _on_error(self, error: InferenceServerException) -> None:
        message = error.message() or str(error)
        if error.status() is not None:  # the stream itself failed (cancelled, connection lost)
            with self._lock:
                self._stream_error = f"stream to {self.url} failed: {message}"
                self._lock.notify_all()
            self._fail_unfinished(self._stream_error)
            return
        with self._lock:
            self._unmatched_errors.append(message)
            self._match_errors()

    def _match_errors(self) -> None:
        """With the lock held: once unfinished requests are exactly as many as unmatched errors, those
        errors are theirs (errors end a request; so does a final response)."""
        if not self._unmatched_errors:
            return
        open_ids = [rid for rid in self._order if self._pending[rid].done_s is None]
        if len(open_ids) != len(self._unmatched_errors):
            return
        now = time.perf_counter()
        for rid, message in zip(open_ids, self._unmatched_errors):
            self._pending[rid].done_s = now
            self._pending[rid].error = message
        self._unmatched_errors.clear()
        self._lock.notify_all()


def generate(
    url: str,
    prompt: str,
    *,
    sampling: Mapping[str, Any] | None = None,
    stream: bool = True,
    exclude_input_in_output: bool | None = None,
    tier: str | None = None,
    tenant: str | None = None,
    cache: str | None = None,
    model: str = "llm",
    on_piece: PieceCallback | None = None,
    timeout_s: float = 120.0,
    tenant_token: str | None = None,
) -> GenerationResult:
    """Run one request to completion; raises GenerationError with the server's message on failure."""
    with StreamingSession(url, model=model) as session:
        rid = session.submit(
            prompt, sampling=sampling, stream=stream, exclude_input_in_output=exclude_input_in_output,
            tier=tier, tenant=tenant, cache=cache, on_piece=on_piece, tenant_token=tenant_token,
        )  # fmt: skip
        if not session.wait([rid], timeout_s):
            session.cancel()
            raise GenerationError(f"no final response within {timeout_s:g} s; the request was cancelled")
        result = session.result(rid)
    if result.error is not None:
        raise GenerationError(result.error)
    return result
