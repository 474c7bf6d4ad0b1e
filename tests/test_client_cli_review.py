"""Client CLI bugs found in review (2026-12-07): client.load --timeout took nan/inf/0, an unwritable
--records path was a traceback after the whole run, and prime's readiness check had no deadline."""

from __future__ import annotations

import importlib
import io
import threading
import time
from concurrent import futures

import grpc
import pytest

from tests.test_load_faults import NeverAnsweringClient, Words

gen = importlib.import_module("client.generate")
load = importlib.import_module("client.load")
cli = importlib.import_module("client.__main__")


LOAD_ARGV = [
    "--count",
    "1",
    "--rate",
    "100",
    "--url",
    "x:1",
    "--targets",
    "standard=100",
    "--mix",
    "standard=1",
]


def _in_thread(fn, seconds):
    box: dict = {}

    def go():
        try:
            box["rc"] = fn()
        except SystemExit as exc:
            box["rc"] = exc.code
        except BaseException as exc:  # noqa: BLE001
            box["exc"] = exc

    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(seconds)
    return t.is_alive(), box


# A: client.load --timeout took nan/inf/0/negative (the other client commands use deploy.arg_types.seconds)
@pytest.mark.parametrize("value", ["nan", "inf", "0", "-1"])
def test_load_timeout_must_be_finite_and_positive(monkeypatch, value):
    """--timeout nan: _drain's deadline is nan, `now >= nan` is never true, so a stalled server makes the
    run wait forever; --timeout 0/-1 calls every request a timeout. A usage error (exit 2) instead."""
    monkeypatch.setattr(gen.grpcclient, "InferenceServerClient", NeverAnsweringClient)
    monkeypatch.setattr(load, "CorpusPrompts", Words)
    argv = [*LOAD_ARGV, "--timeout", value]
    hung, box = _in_thread(lambda: load.main(argv, io.StringIO(), io.StringIO()), 5.0)
    assert not hung, f"client.load --timeout {value} hangs on a server that does not answer"
    assert "exc" not in box, box.get("exc")
    assert box["rc"] == 2


# --- B: client.load --records to a path that cannot be written: a traceback after the whole run
def test_load_records_path_that_cannot_be_written_is_an_error_not_a_traceback(monkeypatch, tmp_path):
    monkeypatch.setattr(gen.grpcclient, "InferenceServerClient", NeverAnsweringClient)
    monkeypatch.setattr(load, "CorpusPrompts", Words)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    err = io.StringIO()
    argv = [*LOAD_ARGV, "--timeout", "0.2", "--records", str(blocker / "records.jsonl")]
    try:
        rc = load.main(argv, io.StringIO(), err)
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"traceback instead of an error line: {exc!r}")
    assert rc == 2 and "error:" in err.getvalue(), err.getvalue()


# --- C: prime's readiness check has no deadline
class _Stall(grpc.GenericRpcHandler):
    """A gRPC server that accepts every call and never answers (a wedged tritonserver)."""

    def __init__(self, release: threading.Event) -> None:
        self.release = release

    def service(self, details):
        def unary(request, context):
            self.release.wait(30)
            context.abort(grpc.StatusCode.UNAVAILABLE, "released")

        return grpc.unary_unary_rpc_method_handler(unary)


@pytest.fixture
def stalled_server():
    release = threading.Event()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), handlers=[_Stall(release)])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        release.set()
        server.stop(0)


def test_prime_readiness_check_honours_timeout(stalled_server, monkeypatch):
    """`prime --timeout 1` against a server that accepts the call and never answers: is_model_ready is
    called without client_timeout, so the readiness probe waits for good instead of failing (exit 1)."""
    monkeypatch.delenv("LLM_TENANT_SECRET", raising=False)
    out, err = io.StringIO(), io.StringIO()
    started = time.monotonic()
    hung, box = _in_thread(
        lambda: cli.main(["prime", "--url", stalled_server, "--timeout", "1"], out, err), 10.0
    )
    assert not hung, "prime --timeout 1 still waiting on the readiness check after 10 s"
    assert box.get("rc") == 1 and err.getvalue().startswith("error:"), (box, err.getvalue())
    assert time.monotonic() - started < 10
