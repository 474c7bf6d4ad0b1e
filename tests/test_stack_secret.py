"""deploy/stack_secret.py: a stack started without a tenant secret gets one of its own, since a server
without one serves tenant `default` only (scheduler/tenant_auth.py)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from deploy.stack_secret import TENANT_SECRET_FILE, provide_tenant_secret, read_tenant_secret
from scheduler.tenant_auth import SECRET_ENV, TRUST_ENV, TenantAuth


def test_a_stack_without_a_secret_gets_one_only_its_owner_can_read(tmp_path: Path) -> None:
    env: dict[str, str] = {}
    process: dict[str, str] = {}
    path = provide_tenant_secret(tmp_path, env, process)
    assert path == tmp_path / TENANT_SECRET_FILE and stat.S_IMODE(path.stat().st_mode) == 0o600
    secret = read_tenant_secret(path)
    assert secret and len(secret) == 64 and env[SECRET_ENV] == process[SECRET_ENV] == secret
    assert TenantAuth.from_env(env).enabled
    again: dict[str, str] = {}
    provide_tenant_secret(tmp_path, again, {})
    assert again[SECRET_ENV] != secret  # a new stack, a new secret


def test_a_process_secret_the_stack_goes_without_is_kept(tmp_path: Path) -> None:
    process = {SECRET_ENV: "the tests' own"}
    env = {SECRET_ENV: ""}  # told to start without it (a test of the no-secret path)
    assert provide_tenant_secret(tmp_path, env, process) is not None
    assert process == {SECRET_ENV: "the tests' own"} and env[SECRET_ENV] != "the tests' own"


@pytest.mark.parametrize("env", [{SECRET_ENV: "the operator's"}, {TRUST_ENV: "true"}])
def test_none_is_made_when_tenants_are_authenticated_or_trusted(tmp_path: Path, env: dict) -> None:
    process: dict[str, str] = {}
    assert provide_tenant_secret(tmp_path, dict(env), process) is None
    assert not (tmp_path / TENANT_SECRET_FILE).exists() and process == {}


def test_settings_the_servers_would_refuse_fail_the_launch(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        provide_tenant_secret(tmp_path, {TRUST_ENV: "maybe"}, {})
