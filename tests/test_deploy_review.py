"""Review of deploy/: launch and stop failure paths. No tritonserver needed (fake servers / sockets)."""

from __future__ import annotations

import http.server
import json
import subprocess
import threading
import time
from pathlib import Path

import pytest

import deploy.launch as launch
from deploy.launch import stop_run_dir

REPO = Path("/work/main")


def _run_in_thread(fn, timeout_s):
    """fn() in a daemon thread; (finished, result-or-exception)."""
    box = {}

    def target():
        try:
            box["result"] = fn()
        except BaseException as exc:  # noqa: BLE001
            box["error"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout_s)
    return (not t.is_alive()), box


# ------------------------------------------------------------------------------------------------ 1
# A stale stack.json (its tritonserver long gone: a reboot, a crash) whose metrics port another
# server holds now: stopping it must not "drain" that other server (scrape it, wait for it to idle).


class _BusyMetrics(http.server.BaseHTTPRequestHandler):
    hits = 0

    def do_GET(self):  # noqa: N802
        type(self).hits += 1
        body = b'nv_inference_pending_request_count{model="llm_engine",version="1"} 3\n'
        body += b'llm_engine_requests{state="running"} 3\n'
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_stopping_a_stale_stack_does_not_drain_whatever_now_serves_its_metrics_port(tmp_path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _BusyMetrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        from client.metrics import holds_requests, scrape_metrics

        assert holds_requests(scrape_metrics(f"http://localhost:{port}/metrics", timeout=5))  # it is busy
        _BusyMetrics.hits = 0
        run_dir = tmp_path / "run"
        run_dir.mkdir()
        pid = _dead_pid()
        stack = {
            "grpc_port": 1, "http_port": 2, "metrics_port": port, "redis_port": None,
            "redis_url": "redis://localhost:1/0", "pids": {"tritonserver": pid},
            "create_times": {"tritonserver": time.time() - 3600}, "run_dir": str(run_dir),
            "triton_log": str(run_dir / "tritonserver.log"), "redis_log": None,
        }  # fmt: skip
        (run_dir / "stack.json").write_text(json.dumps(stack))
        t0 = time.monotonic()
        done, box = _run_in_thread(lambda: stop_run_dir(run_dir, timeout_s=1), 8.0)
        assert done, "stop of a dead stack waited on another server's requests (drain)"
        assert box.get("result") is True
        assert time.monotonic() - t0 < 5
        assert _BusyMetrics.hits == 0, "the stop scraped a server that is not the recorded stack's"
    finally:
        server.shutdown()
        server.server_close()


# ------------------------------------------------------------------------------------------------ 3
# The launcher CLI: an error it can foresee is a clear message and exit 1, not a traceback.


def _launch(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(REPO / ".venv/bin/python"), "-m", "deploy.launch", *argv],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_a_tritonserver_that_cannot_be_executed_is_a_clear_error(tmp_path):
    server = tmp_path / "tritonserver"
    server.write_text("#!/bin/sh\nexit 0\n")  # a file, but not executable (mode 0644)
    r = _launch(
        "--run-dir", str(tmp_path / "run"), "--no-redis", "--redis-url", "redis://localhost:1/0",
        "--tritonserver", str(server), "--backend-dir", str(tmp_path), "--no-prime", "--timeout", "5",
        cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 1, r
    assert "Traceback" not in r.stderr, r.stderr
    assert "[launch] error:" in r.stderr


def test_a_run_dir_that_is_a_file_is_a_clear_error(tmp_path):
    not_a_dir = tmp_path / "busy"
    not_a_dir.write_text("a file\n")
    r = _launch("--run-dir", str(not_a_dir), "--no-prime", cwd=tmp_path)
    assert r.returncode == 1, r
    assert "Traceback" not in r.stderr, r.stderr
    assert "[launch] error:" in r.stderr


def test_the_launchers_readiness_timeout_must_be_a_finite_number(capsys):
    """--timeout nan made `now - t0 > timeout` never true: the readiness wait had no bound at all."""
    with pytest.raises(SystemExit) as exc:
        launch.main(["--timeout", "nan", "--tritonserver", "/nonexistent/tritonserver"])
    assert exc.value.code == 2


def test_the_stops_grace_must_be_a_finite_number(tmp_path, capsys):
    """deploy.stop --timeout nan: `now < started + nan` is false at once, so every process got SIGKILL
    with no SIGTERM grace (tritonserver never unloaded its models)."""
    import deploy.stop

    with pytest.raises(SystemExit) as exc:
        deploy.stop.main(["--timeout", "nan", "--run-dir", str(tmp_path)])
    assert exc.value.code == 2


# ------------------------------------------------------------------------------------------------ 4
# A Redis URL with credentials (--redis-url / REDIS_URL, README: "printed redacted") was written in
# clear into stack.json and the rendered config.pbtxt files, both world-readable (umask 022), next to
# a tenant_secret the launcher makes 0600 precisely because others may read that directory.


def test_redis_credentials_are_not_left_readable_by_others_in_the_run_dir(tmp_path, monkeypatch):
    import os
    import stat

    from scheduler.tenant_auth import SECRET_ENV

    monkeypatch.setenv(SECRET_ENV, "s")
    monkeypatch.setattr(launch, "_wait_ready", lambda stack, triton, opts: None)
    old = os.umask(0o022)
    server = tmp_path / "tritonserver"
    server.write_text("#!/bin/sh\nexec sleep 60\n")
    server.chmod(0o755)
    password = "hunter2-redis-password"
    opts = launch.StackOptions(
        run_dir=tmp_path / "run", start_redis=False, redis_url=f"redis://:{password}@localhost:1/0",
        tritonserver=str(server), backend_dir=str(tmp_path), triton_libs="", repo_pth=False, prime=False,
    )  # fmt: skip
    stack = launch.start_stack(opts)
    try:
        os.umask(old)
        exposed = []
        configs = (stack.run_dir / "model_repository").glob("*/config.pbtxt")
        for path in [stack.run_dir / "stack.json", *configs]:
            if password in path.read_text() and path.stat().st_mode & (stat.S_IRGRP | stat.S_IROTH):
                exposed.append(path.name if path.name == "stack.json" else path.parent.name)
        assert not exposed, f"the Redis password is readable by other users in {exposed}"
        assert stack.redis_url.endswith("@localhost:1/0")  # the server itself still gets it
    finally:
        os.umask(old)
        stack.stop(timeout_s=5, drain_timeout_s=0)
