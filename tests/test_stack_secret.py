"""deploy/stack_secret.py: a stack started without a tenant secret gets one of its own, since a server
without one serves tenant `default` only (scheduler/tenant_auth.py)."""

from __future__ import annotations

from deploy.stack_secret import TENANT_SECRET_FILE, provide_tenant_secret

import os
import stat
from pathlib import Path

import pytest

from deploy.stack_secret import (
    read_tenant_secret,
    share_tenant_secret,
)
from scheduler.tenant_auth import SECRET_ENV, TRUST_ENV, TenantAuth


def test_a_stack_without_a_secret_gets_one_only_its_owner_can_read(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv(SECRET_ENV)
    env: dict[str, str] = {}
    path = provide_tenant_secret(tmp_path, env)
    assert path == tmp_path / TENANT_SECRET_FILE and stat.S_IMODE(path.stat().st_mode) == 0o600
    secret = read_tenant_secret(path)
    assert secret and len(secret) == 64 and env[SECRET_ENV] == secret
    assert TenantAuth.from_env(env).enabled
    # not in this process's environment: a second stack started here would serve with it unrecorded
    assert SECRET_ENV not in os.environ
    again: dict[str, str] = {}
    provide_tenant_secret(tmp_path, again)
    assert again[SECRET_ENV] != secret  # a new stack, a new secret


@pytest.mark.parametrize("env", [{SECRET_ENV: "the operator's"}, {TRUST_ENV: "true"}])
def test_none_is_made_when_tenants_are_authenticated_or_trusted(tmp_path: Path, env: dict) -> None:
    assert provide_tenant_secret(tmp_path, dict(env)) is None
    assert not (tmp_path / TENANT_SECRET_FILE).exists()


def test_settings_the_servers_would_refuse_fail_the_launch(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        provide_tenant_secret(tmp_path, {TRUST_ENV: "maybe"})


def test_a_process_that_starts_stacks_shares_one_secret_with_them() -> None:
    environ: dict[str, str] = {}
    secret = share_tenant_secret(environ)
    assert environ == {SECRET_ENV: secret} and share_tenant_secret(environ) == secret
    assert share_tenant_secret({SECRET_ENV: "the operator's"}) == "the operator's"


def test_a_stale_world_readable_secret_file_never_receives_the_new_secret(tmp_path: Path, monkeypatch):
    """provide_tenant_secret reopened a file left in the run dir (O_TRUNC keeps its inode and mode) and
    wrote the new secret into it before the chmod to 0600: a handle opened while it was world-readable
    read the stack's new secret (found in review, 2026-12-07)."""
    monkeypatch.delenv(SECRET_ENV, raising=False)
    stale = tmp_path / TENANT_SECRET_FILE
    stale.write_text("an earlier secret\n")
    os.chmod(stale, 0o644)
    with open(stale) as other_user:  # opened while the file was readable by others
        env: dict[str, str] = {}
        path = provide_tenant_secret(tmp_path, env)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert env[SECRET_ENV] not in other_user.read()
