"""Client unit tests: input tensors, CLI parsing, and the stream protocol against an in-process fake
gRPC server that speaks Triton's ModelStreamInfer (no tritonserver needed)."""

from __future__ import annotations

import io
import json
import queue
import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import deserialize_bytes_tensor, serialize_byte_tensor

from client.__main__ import build_parser, format_stats, main, sampling_from_args
from scheduler.tenant_auth import SECRET_ENV
from client.generate import (
    GenerationError,
    GenerationResult,
    StreamingSession,
    build_inputs,
    generate,
    input_arrays,
)

# ---------------------------------------------------------------- input tensors


def contents(prompt: str, **options: object) -> dict[str, tuple[str, list[int], object]]:
    out = {}
    for tensor in build_inputs(prompt, **options):
        raw = tensor._get_content()
        if tensor.datatype() == "BYTES":
            value = [v.decode() for v in deserialize_bytes_tensor(raw)]
        else:
            value = np.frombuffer(raw, dtype=np.bool_).tolist()
        out[tensor.name()] = (tensor.datatype(), tensor.shape(), value)
    return out


def test_minimal_inputs(monkeypatch) -> None:
    monkeypatch.delenv(SECRET_ENV)  # with it, the tools also send default's token (test_tenant_auth.py)
    assert contents("héllo 🙂") == {
        "text_input": ("BYTES", [1], ["héllo 🙂"]),
        "stream": ("BOOL", [1], [True]),
    }


def test_all_inputs() -> None:
    got = contents(
        "hi", sampling={"max_tokens": 4, "stop": ["x"]}, stream=False, exclude_input_in_output=True,
        tier="critical", tenant="acme",
    )  # fmt: skip
    assert list(got) == [
        "text_input", "stream", "sampling_parameters", "exclude_input_in_output", "slo_tier", "tenant",
        "tenant_token",  # the suite's servers authenticate tenants (tests/conftest.py)
    ]  # fmt: skip
    assert got["stream"] == ("BOOL", [1], [False])
    assert json.loads(got["sampling_parameters"][2][0]) == {"max_tokens": 4, "stop": ["x"]}
    assert got["exclude_input_in_output"] == ("BOOL", [1], [True])
    assert got["slo_tier"] == ("BYTES", [1], ["critical"])
    assert got["tenant"] == ("BYTES", [1], ["acme"])


def test_false_exclude_input_is_still_sent() -> None:
    arrays = input_arrays("hi", exclude_input_in_output=False, sampling={})
    assert arrays["exclude_input_in_output"].tolist() == [False]
    assert arrays["sampling_parameters"].tolist() == [b"{}"]


# ---------------------------------------------------------------- CLI parsing


def test_cli_defaults() -> None:
    args = build_parser().parse_args(["generate", "Hello there"])
    # no --url: main() resolves it (the running stack of `make run`, else localhost:8001;
    # tests/test_stack_defaults.py)
    assert args.prompt == "Hello there" and args.url is None and args.model == "llm"
    assert args.stream is True and args.tier is None and args.tenant is None
    assert args.exclude_input_in_output is None
    assert sampling_from_args(args) is None  # nothing given: no sampling_parameters tensor


def test_cli_all_options() -> None:
    args = build_parser().parse_args([
        "generate", "--url", "h:9", "--max-tokens", "8", "--temperature", "0.5", "--seed", "7", "--top-p",
        "0.9", "--top-k", "5", "--stop", "\n", "--stop", "END", "--ignore-eos", "--tier", "critical",
        "--tenant", "t1", "--no-stream", "--exclude-input", "--timeout", "3", "--model", "m", "P",
    ])  # fmt: skip
    assert args.url == "h:9" and args.prompt == "P" and args.model == "m" and args.timeout == 3.0
    assert args.stream is False and args.tier == "critical" and args.tenant == "t1"
    assert args.exclude_input_in_output is True
    assert sampling_from_args(args) == {
        "max_tokens": 8, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "seed": 7, "stop": ["\n", "END"],
        "ignore_eos": True,
    }  # fmt: skip


def test_cli_rejects_bad_numbers() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--max-tokens", "many", "P"])


def test_format_stats() -> None:
    result = GenerationResult("ab", ["a", "b"], 0.0123, 0.0456)
    assert format_stats(result) == "TTFT 12.3 ms  total 45.6 ms  pieces 2"
    assert format_stats(GenerationResult("", [], None, 0.001)).startswith("TTFT n/a  total 1.0 ms")


# ---------------------------------------------------------------- fake Triton stream


def _response(request_id: str, piece: str | None, final: bool) -> service_pb2.ModelStreamInferResponse:
    infer = service_pb2.ModelInferResponse(model_name="llm", id=request_id)
    if piece is not None:
        infer.outputs.add(name="text_output", datatype="BYTES", shape=[1])
        infer.raw_output_contents.append(
            serialize_byte_tensor(np.array([piece.encode()], dtype=np.object_)).item()
        )
    if final:
        infer.parameters["triton_final_response"].bool_param = True
    return service_pb2.ModelStreamInferResponse(infer_response=infer)


class FakeLLM(service_pb2_grpc.GRPCInferenceServiceServicer):
    """Decoupled echo model: each word of the prompt is a piece, then an empty final response.

    Prompts starting with 'fail' get an error; 'hang' never finishes until cancelled.
    """

    def __init__(self) -> None:
        self.requests: list[service_pb2.ModelInferRequest] = []
        self.cancelled = threading.Event()

    def ModelStreamInfer(self, request_iterator, context) -> Iterator[service_pb2.ModelStreamInferResponse]:  # noqa: N802
        out: queue.Queue = queue.Queue()
        workers: list[threading.Thread] = []

        def serve(request: service_pb2.ModelInferRequest) -> None:
            inputs = {t.name: raw for t, raw in zip(request.inputs, request.raw_input_contents)}
            prompt = deserialize_bytes_tensor(inputs["text_input"])[0].decode()
            stream = bool(np.frombuffer(inputs["stream"], dtype=np.bool_)[0])
            if prompt.startswith("fail"):
                out.put(service_pb2.ModelStreamInferResponse(
                    error_message=f"unknown slo_tier 'gold'; allowed: critical, standard ({prompt})",
                    infer_response=service_pb2.ModelInferResponse(id=request.id),
                ))  # fmt: skip
                return
            if prompt == "hang":
                while context.is_active():
                    time.sleep(0.01)
                self.cancelled.set()
                return
            words = [w + " " for w in prompt.split()]
            if stream:
                out.put(_response(request.id, "", False))  # an empty piece does not count for TTFT
                for word in words:
                    time.sleep(0.01)
                    out.put(_response(request.id, word, False))
                out.put(_response(request.id, None, True))
            else:
                out.put(_response(request.id, "".join(words), True))

        def read() -> None:
            try:
                for request in request_iterator:
                    self.requests.append(request)
                    worker = threading.Thread(target=serve, args=(request,))
                    workers.append(worker)
                    worker.start()
            except grpc.RpcError:
                pass  # the client cancelled the stream
            for worker in workers:
                worker.join()
            out.put(None)

        threading.Thread(target=read, daemon=True).start()
        while (item := out.get()) is not None:
            yield item


@pytest.fixture
def fake() -> Iterator[tuple[str, FakeLLM]]:
    servicer = FakeLLM()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", servicer
    server.stop(grace=None)


def test_generate_streams_pieces(fake: tuple[str, FakeLLM], monkeypatch) -> None:
    monkeypatch.delenv(SECRET_ENV)  # the inputs as sent without the operator's secret
    url, servicer = fake
    seen: list[str] = []
    result = generate(url, "one two three", sampling={"max_tokens": 3}, tier="critical", on_piece=seen.append)
    assert result.text == "one two three "
    assert result.pieces == ["", "one ", "two ", "three "]
    assert seen == ["one ", "two ", "three "]
    assert result.error is None and result.ttft_s is not None and 0 < result.ttft_s <= result.total_s
    assert result.first_token_s is not None and 0 < result.first_token_s < result.ttft_s  # the empty piece
    request = servicer.requests[0]
    assert request.model_name == "llm" and request.id == result.request_id
    assert request.parameters["triton_enable_empty_final_response"].bool_param
    assert [t.name for t in request.inputs] == ["text_input", "stream", "sampling_parameters", "slo_tier"]


def test_generate_without_streaming(fake: tuple[str, FakeLLM]) -> None:
    result = generate(fake[0], "all at once", stream=False)
    assert result.pieces == ["all at once "] and result.text == "all at once "


def test_generate_error_keeps_server_message(fake: tuple[str, FakeLLM]) -> None:
    expected = r"unknown slo_tier 'gold'; allowed: critical, standard \(fail\)"
    with pytest.raises(GenerationError, match=expected):
        generate(fake[0], "fail")


def test_generate_timeout_cancels(fake: tuple[str, FakeLLM]) -> None:
    url, servicer = fake
    with pytest.raises(GenerationError, match="no final response within 0.3 s"):
        generate(url, "hang", timeout_s=0.3)
    assert servicer.cancelled.wait(5)


def test_unreachable_server_is_explained() -> None:
    with pytest.raises(GenerationError, match="stream to 127.0.0.1:1 failed"):
        generate("127.0.0.1:1", "hi", timeout_s=5)


def test_session_concurrent_requests(fake: tuple[str, FakeLLM]) -> None:
    url, servicer = fake
    with StreamingSession(url) as session:
        ids = [session.submit(f"request {i} " + "w " * i) for i in range(5)]
        assert len(set(ids)) == 5
        assert session.wait(timeout_s=10)
        results = session.results()
    assert list(results) == ids
    for i, rid in enumerate(ids):
        assert results[rid].text == f"request {i} " + "w " * i
        assert results[rid].error is None
    assert len(servicer.requests) == 5


def test_session_attributes_a_single_error(fake: tuple[str, FakeLLM]) -> None:
    with StreamingSession(fake[0]) as session:
        good = session.submit("fine words here")
        bad = session.submit("fail now")
        assert session.wait(timeout_s=10)
        assert session.result(good).error is None and session.result(good).text == "fine words here "
        assert "allowed: critical, standard (fail now)" in (session.result(bad).error or "")


def test_session_cancel(fake: tuple[str, FakeLLM]) -> None:
    url, servicer = fake
    with StreamingSession(url) as session:
        done = session.submit("quick")
        assert session.wait([done], timeout_s=10)
        stuck = session.submit("hang")
        assert not session.wait([stuck], timeout_s=0.2)
        session.cancel()
        assert session.result(stuck).error == "cancelled by the client"
        assert session.result(done).error is None
        with pytest.raises(GenerationError, match="session is closed"):
            session.submit("more")
    assert servicer.cancelled.wait(5)


def test_duplicate_request_id_rejected(fake: tuple[str, FakeLLM]) -> None:
    with StreamingSession(fake[0]) as session:
        session.submit("a", request_id="x")
        with pytest.raises(ValueError, match="already used"):
            session.submit("b", request_id="x")
        session.wait(timeout_s=10)


def test_cli_prints_pieces_and_stats(fake: tuple[str, FakeLLM]) -> None:
    out, err = io.StringIO(), io.StringIO()
    assert main(["generate", "--url", fake[0], "--max-tokens", "4", "hello world"], out, err) == 0
    lines = out.getvalue().splitlines()
    assert lines[0] == "hello world "
    assert lines[1].startswith("TTFT ") and lines[1].endswith("pieces 3")
    assert err.getvalue() == ""


def test_cli_error_exit_code(fake: tuple[str, FakeLLM]) -> None:
    out, err = io.StringIO(), io.StringIO()
    assert main(["generate", "--url", fake[0], "fail"], out, err) == 1
    assert err.getvalue().startswith("error: unknown slo_tier 'gold'; allowed:")
    assert out.getvalue() == ""  # no piece came: no blank line before the error


def test_requests_carry_their_tier_as_triton_priority():
    from client.generate import tier_priority

    assert [tier_priority(t) for t in ("critical", "warmup", "standard", "batch")] == [1, 2, 3, 4]
    assert tier_priority(None) == 0 and tier_priority("custom-tier") == 0


def test_histogram_quantile_from_two_scrapes():
    from client.metrics import histogram_delta, histogram_quantile, parse_metrics

    def scrape(counts):
        lines = []
        for tier, per_le in counts.items():
            for le, n in per_le.items():
                lines.append(f'llm_scheduler_overhead_seconds_bucket{{tier="{tier}",le="{le}"}} {n}')
        return parse_metrics("\n".join(lines))

    before = scrape({"a": {"0.001": 5, "0.01": 5, "+Inf": 5}})
    after = scrape(
        {"a": {"0.001": 100, "0.01": 104, "+Inf": 105}, "b": {"0.001": 100, "0.01": 100, "+Inf": 100}}
    )
    buckets = histogram_delta(before, after, "llm_scheduler_overhead_seconds")
    assert buckets == {0.001: 195, 0.01: 199, float("inf"): 200}
    assert histogram_quantile(buckets, 0.95) == 0.001
    assert histogram_quantile(buckets, 0.99) == 0.01
    assert histogram_quantile(buckets, 1.0) == float("inf")
    assert histogram_quantile({}, 0.99) is None
