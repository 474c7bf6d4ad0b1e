"""The launcher's own tenant secret (deploy/stack_secret.py) across stacks of one process, on a failed
start, and for its priming. A fake tritonserver (a shell script) stands in for the server; readiness is
skipped. Found by a review of the first version, which exported the secret to the process environment."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import client.prime
import deploy.launch as launch
from client.prime import PRIME_TENANT
from deploy.launch import StackError, StackOptions, start_stack
from deploy.stack_secret import TENANT_SECRET_FILE, read_tenant_secret
from scheduler.tenant_auth import SECRET_ENV, TRUST_ENV, TenantAuth

WAIT_READY = launch._wait_ready


def options(tmp_path: Path, run_dir: Path, body: str = "exec sleep 60") -> StackOptions:
    server = tmp_path / "tritonserver"
    server.write_text(f"#!/bin/sh\n{body}\n")
    server.chmod(0o755)
    return StackOptions(
        run_dir=run_dir, start_redis=False, redis_url="redis://localhost:1/0", tritonserver=str(server),
        backend_dir=str(tmp_path), triton_libs="", repo_pth=False, prime=False, ready_timeout_s=2.0,
    )  # fmt: skip


@pytest.fixture
def no_process_secret(monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)  # the suite's own, restored at teardown
    monkeypatch.delenv(TRUST_ENV, raising=False)
    monkeypatch.setattr(launch, "_wait_ready", lambda stack, triton, opts: None)
    return monkeypatch


def test_each_stack_of_a_process_records_a_secret_of_its_own(tmp_path, no_process_secret):
    stacks = [start_stack(options(tmp_path, tmp_path / name)) for name in ("one", "two")]
    try:
        files = [json.loads((s.run_dir / "stack.json").read_text())["tenant_secret_file"] for s in stacks]
        secrets = [read_tenant_secret(f) for f in files]
        assert all(secrets) and secrets[0] != secrets[1]
        assert [s.tenant_secret for s in stacks] == secrets
        assert SECRET_ENV not in os.environ  # never the process's: a later stack would take it for its own
    finally:
        for stack in stacks:
            stack.stop(timeout_s=5, drain_timeout_s=0)
    assert not any(Path(f).exists() for f in files)  # stop removes each stack's file


def test_a_failed_start_leaves_no_secret_behind(tmp_path, no_process_secret):
    run_dir = tmp_path / "run"
    no_process_secret.setattr(launch, "_wait_ready", WAIT_READY)  # it notices the server exit
    with pytest.raises(StackError):
        start_stack(options(tmp_path, run_dir, body="exit 3"))  # the fake server exits at once
    assert not (run_dir / "stack.json").exists() and not (run_dir / TENANT_SECRET_FILE).exists()
    assert SECRET_ENV not in os.environ


def test_priming_signs_with_the_secret_the_stack_serves_with(tmp_path, no_process_secret):
    """A process with a secret that starts a stack told to go without one: the stack makes its own, and
    priming signed with the process's environment was refused by it."""
    no_process_secret.setenv(SECRET_ENV, "the process's own")
    sent = []
    no_process_secret.setattr(
        client.prime, "prime", lambda config: sent.append(config) or client.prime.PrimeResult()
    )
    opts = options(tmp_path, tmp_path / "run")
    opts.prime, opts.extra_env = True, {SECRET_ENV: ""}
    stack = start_stack(opts)
    try:
        served_with = read_tenant_secret(stack.tenant_secret_file)
        assert served_with and served_with != "the process's own" and sent
        TenantAuth(secret=served_with.encode()).check(PRIME_TENANT, sent[0].tenant_token, None)
    finally:
        stack.stop(timeout_s=5, drain_timeout_s=0)
