"""A tenant secret for a stack started without one, so that its named tenants work for those who can read it.

A server with no `LLM_TENANT_SECRET` serves tenant `default` only (scheduler/tenant_auth.py): the key
salt is the server's to set, and with nothing to check a claim against, naming a tenant cannot be
enough. A stack started without a secret (nor `LLM_TENANT_TRUST_CLIENT=true`) gets one of its own, in
`<run_dir>/tenant_secret` (mode 0600, named in stack.json), which the client tools read for a stack they
target (client/stack_defaults.py); the launcher's `Stack` holds it for its own priming. It never enters
the launching process's environment: a second stack started there would take it for the operator's,
and serve with it unrecorded. Processes that start stacks and sign tenants themselves (benchmarks, the
tests) set one secret of their own first, which their stacks inherit. Replicas that must accept one
another's tokens need the operator's secret: one made here is its stack's alone.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import MutableMapping
from pathlib import Path

from scheduler.tenant_auth import SECRET_ENV, TenantAuth

TENANT_SECRET_FILE = "tenant_secret"


def provide_tenant_secret(run_dir: Path, env: MutableMapping[str, str]) -> Path | None:
    """Give the server environment `env` a secret of its own unless it authenticates tenants or trusts
    them already; returns the file that holds it (None: none made). ValueError: tenant settings that
    make no sense (as the servers would refuse them)."""
    auth = TenantAuth.from_env(env)
    if auth.enabled or auth.trust_client:
        return None
    secret = secrets.token_hex(32)
    path = Path(run_dir) / TENANT_SECRET_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    os.chmod(path, 0o600)  # a file left by an earlier stack keeps its mode under O_CREAT
    env[SECRET_ENV] = secret
    return path


def read_tenant_secret(path: Path | str | None) -> str | None:
    """The secret a stack's file holds; None when there is none to read."""
    if not path:
        return None
    try:
        return Path(path).read_text().strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def share_tenant_secret(environ: MutableMapping[str, str] = os.environ) -> str:
    """One secret for this process, unless it has one: the stacks it starts inherit it, and its clients
    sign their tenants with it (client.generate makes tokens from it). For processes that start stacks
    and name tenants (benchmarks); returns the secret."""
    if not environ.get(SECRET_ENV):
        environ[SECRET_ENV] = secrets.token_hex(32)
    return environ[SECRET_ENV]
