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
import tempfile
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
    path = write_owner_only(Path(run_dir) / TENANT_SECRET_FILE, secret + "\n")
    env[SECRET_ENV] = secret
    return path


def write_owner_only(path: Path, text: str) -> Path:
    """Write `text` to a new file only its owner may read, then move it onto `path`. A file left there
    (an earlier stack's, maybe readable by others, maybe held open) is replaced, never written into: a
    handle opened on it while it was readable would read the new contents."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # mode 0600
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
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
