"""Where the client commands send requests when ``--url`` / ``--metrics-url`` are not given.

``make run`` (``python -m deploy.launch``) starts tritonserver on free ports and records them in
``.run/main/stack.json``. While the tritonserver that file names is running, its gRPC and metrics
addresses are the defaults; otherwise (no such file, an unreadable one, a stack that was stopped or
crashed) Triton's standard ports on localhost: ``localhost:8001`` and ``http://localhost:8002/metrics``.

A stack started without ``LLM_TENANT_SECRET`` signs tenants with a secret of its own
(deploy/stack_secret.py); a command sent to it by a process with no secret signs with that one, for
that command only (``signing_for``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from pathlib import Path

from deploy.processes import same_process
from deploy.stack_secret import read_tenant_secret
from scheduler.tenant_auth import SECRET_ENV

REPO_ROOT = Path(__file__).resolve().parents[1]
STACK_FILE = REPO_ROOT / ".run" / "main" / "stack.json"  # deploy.launch's DEFAULT_RUN_DIR / STACK_FILE
FALLBACK_GRPC_URL = "localhost:8001"
FALLBACK_METRICS_URL = "http://localhost:8002/metrics"
URL_HELP = "default: the stack .run/main/stack.json names while it runs (make run), else"


def running_stack(path: Path | str | None = None) -> dict | None:
    """The contents of a stack.json (default: STACK_FILE) whose tritonserver is alive; None otherwise."""
    try:
        data = json.loads(Path(STACK_FILE if path is None else path).read_text())
        pid = int(data["pids"]["tritonserver"])
        create_time = (data.get("create_times") or {}).get("tritonserver")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return data if same_process(pid, create_time) else None


def _from_stack(key: str, fallback: str, path: Path | str | None) -> str:
    stack = running_stack(path)
    value = stack.get(key) if stack else None
    return value if isinstance(value, str) and value else fallback


def default_grpc_url(path: Path | str | None = None) -> str:
    """Triton's gRPC address for a command given no --url."""
    return _from_stack("grpc_url", FALLBACK_GRPC_URL, path)


def default_metrics_url(path: Path | str | None = None) -> str:
    """Triton's metrics URL for a command given no --metrics-url."""
    return _from_stack("metrics_url", FALLBACK_METRICS_URL, path)


def stack_secret(url: str, path: Path | str | None = None) -> str | None:
    """The secret the running stack at `url` (its gRPC address) made for itself; None: no such stack,
    or it serves with the operator's."""
    stack = running_stack(path)
    if not stack or not _same_local_address(url, stack.get("grpc_url")):
        return None
    return read_tenant_secret(stack.get("tenant_secret_file"))


@contextmanager
def signing_for(
    url: str, environ: MutableMapping[str, str] = os.environ, path: Path | str | None = None
) -> Iterator[bool]:
    """While a command runs, sign its tenants with the secret of the stack at `url` it is sent to, unless
    the process has LLM_TENANT_SECRET; yields whether it does. Read afresh for each command (a restarted
    stack has a new secret), and taken out of the environment after it: in-process callers keep theirs."""
    secret = None if environ.get(SECRET_ENV) else stack_secret(url, path)
    if secret is None:
        yield False
        return
    environ[SECRET_ENV] = secret
    try:
        yield True
    finally:
        if environ.get(SECRET_ENV) == secret:
            del environ[SECRET_ENV]


LOCAL_HOSTS = ("localhost", "127.0.0.1", "[::1]", "::1")


def _same_local_address(url: str, stack_url: object) -> bool:
    """Whether `url` names the stack's gRPC port on this machine (the stack records 'localhost:P')."""
    if not isinstance(stack_url, str) or not url:
        return False
    host, _, port = url.rpartition(":")
    _, _, stack_port = stack_url.rpartition(":")
    return host in LOCAL_HOSTS and port == stack_port
