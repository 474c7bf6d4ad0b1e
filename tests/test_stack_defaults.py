"""The client commands' default addresses: the running stack of `make run` (.run/main/stack.json),
else localhost:8001 / :8002 (client/stack_defaults.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from client import stack_defaults
from client.__main__ import build_parser, resolve_default_urls
from client.stack_defaults import (
    FALLBACK_GRPC_URL,
    FALLBACK_METRICS_URL,
    default_grpc_url,
    default_metrics_url,
    running_stack,
)


def write_stack(path: Path, pid: int, create_time: float | None, port: int = 41234) -> Path:
    """A stack.json of the shape deploy.launch writes (Stack.to_json)."""
    data = {
        "grpc_port": port,
        "http_port": port + 1,
        "metrics_port": port + 2,
        "redis_port": port + 3,
        "grpc_url": f"localhost:{port}",
        "http_url": f"localhost:{port + 1}",
        "metrics_url": f"http://localhost:{port + 2}/metrics",
        "redis_url": f"redis://localhost:{port + 3}/0",
        "pids": {"redis": pid, "tritonserver": pid},
        "create_times": {} if create_time is None else {"redis": create_time, "tritonserver": create_time},
        "run_dir": str(path.parent),
        "triton_log": str(path.parent / "tritonserver.log"),
        "redis_log": str(path.parent / "redis.log"),
    }
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def this_process(tmp_path: Path) -> Path:
    """A stack whose 'tritonserver' is this test's process: alive, and the recorded one."""
    return write_stack(tmp_path / "stack.json", os.getpid(), psutil.Process().create_time())


def test_a_live_stack_gives_its_urls(tmp_path: Path) -> None:
    path = this_process(tmp_path)
    assert running_stack(path)["grpc_port"] == 41234
    assert default_grpc_url(path) == "localhost:41234"
    assert default_metrics_url(path) == "http://localhost:41236/metrics"


def test_no_stack_file_falls_back_to_the_standard_ports(tmp_path: Path) -> None:
    path = tmp_path / "stack.json"
    assert running_stack(path) is None
    assert default_grpc_url(path) == FALLBACK_GRPC_URL == "localhost:8001"
    assert default_metrics_url(path) == FALLBACK_METRICS_URL == "http://localhost:8002/metrics"


def test_a_stopped_stack_falls_back(tmp_path: Path) -> None:
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    path = write_stack(tmp_path / "stack.json", done.pid, None)
    assert default_grpc_url(path) == FALLBACK_GRPC_URL
    assert default_metrics_url(path) == FALLBACK_METRICS_URL


def test_a_reused_pid_is_not_the_stack(tmp_path: Path) -> None:
    """The pid runs, but it started at another time than the recorded tritonserver."""
    path = write_stack(tmp_path / "stack.json", os.getpid(), psutil.Process().create_time() - 3600)
    assert default_grpc_url(path) == FALLBACK_GRPC_URL


@pytest.mark.parametrize("text", ["", "not json", "[]", '{"pids": {}}', '{"pids": {"tritonserver": "x"}}'])
def test_an_unreadable_stack_file_falls_back(tmp_path: Path, text: str) -> None:
    path = tmp_path / "stack.json"
    path.write_text(text)
    assert default_grpc_url(path) == FALLBACK_GRPC_URL
    assert default_metrics_url(path) == FALLBACK_METRICS_URL


@pytest.mark.parametrize(
    "argv",
    [["generate", "P"], ["prime"], ["warmup", "--rewarm"], ["warmup", "--log", "q.jsonl", "--dry-run"]],
)
def test_commands_without_url_use_the_running_stack(tmp_path: Path, monkeypatch, argv: list[str]) -> None:
    monkeypatch.setattr(stack_defaults, "STACK_FILE", this_process(tmp_path))
    args = build_parser().parse_args(argv)
    assert args.url is None
    resolve_default_urls(args)
    assert args.url == "localhost:41234"


def test_cache_without_metrics_url_uses_the_running_stack(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(stack_defaults, "STACK_FILE", this_process(tmp_path))
    args = build_parser().parse_args(["cache"])
    resolve_default_urls(args)
    assert args.metrics_url == "http://localhost:41236/metrics"


def test_given_urls_win_over_the_running_stack(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(stack_defaults, "STACK_FILE", this_process(tmp_path))
    args = build_parser().parse_args(["generate", "--url", "h:9", "P"])
    resolve_default_urls(args)
    assert args.url == "h:9"
    args = build_parser().parse_args(["cache", "--metrics-url", "http://m:1/metrics"])
    resolve_default_urls(args)
    assert args.metrics_url == "http://m:1/metrics"


def test_without_a_stack_the_commands_use_the_standard_ports(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(stack_defaults, "STACK_FILE", tmp_path / "absent" / "stack.json")
    args = build_parser().parse_args(["prime"])
    resolve_default_urls(args)
    assert args.url == "localhost:8001"
    args = build_parser().parse_args(["cache"])
    resolve_default_urls(args)
    assert args.metrics_url == "http://localhost:8002/metrics"


def test_the_load_generator_resolves_its_url_the_same_way(tmp_path: Path, monkeypatch) -> None:
    from client.load import build_parser as load_parser

    assert load_parser().parse_args([]).url is None  # resolved by default_grpc_url() when it sends
    monkeypatch.setattr(stack_defaults, "STACK_FILE", this_process(tmp_path))
    assert default_grpc_url() == "localhost:41234"


def test_the_stack_file_is_the_launchers_default() -> None:
    from deploy.launch import DEFAULT_RUN_DIR, STACK_FILE

    assert stack_defaults.STACK_FILE == DEFAULT_RUN_DIR / STACK_FILE


def test_a_command_to_a_stack_with_its_own_tenant_secret_signs_with_it(tmp_path: Path) -> None:
    """A stack started without LLM_TENANT_SECRET signs tenants with a secret of its own
    (deploy/stack_secret.py); the client tools sent to it read that one, and only for it."""
    me = psutil.Process()
    path = write_stack(tmp_path / "stack.json", me.pid, me.create_time(), port=41234)
    secret_file = tmp_path / "tenant_secret"
    secret_file.write_text("s3cret\n")
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "tenant_secret_file": str(secret_file)}))
    environ: dict[str, str] = {}
    with stack_defaults.signing_for("localhost:9999", environ, path) as signing:
        assert not signing and not environ  # another server's address
    with stack_defaults.signing_for("127.0.0.1:41234", environ, path) as signing:
        assert signing and environ == {"LLM_TENANT_SECRET": "s3cret"}
    assert environ == {}  # for that command only: an in-process caller keeps its environment
    secret_file.write_text("restarted\n")  # a restarted stack's new secret is read afresh
    with stack_defaults.signing_for("localhost:41234", environ, path):
        assert environ == {"LLM_TENANT_SECRET": "restarted"}
    mine = {"LLM_TENANT_SECRET": "the operator's"}
    with stack_defaults.signing_for("localhost:41234", mine, path) as signing:
        assert not signing and mine == {"LLM_TENANT_SECRET": "the operator's"}  # its own wins
    secret_file.unlink()
    with stack_defaults.signing_for("localhost:41234", environ, path) as signing:
        assert not signing
