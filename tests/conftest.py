"""Shared fixtures.

- ``stack`` (session): one Redis + tritonserver stack started with deploy.launch on free ports (warmup on,
  run dir under pytest's tmp), stopped at the end of the session. Tests that use it are marked ``server``
  automatically (select with ``-m server``, skip with ``-m "not server"``).
- ``grpc_url`` ('localhost:P'), ``http_url`` ('localhost:P'), ``metrics_url``
  ('http://localhost:P/metrics'), ``redis_url`` ('redis://localhost:P/0'): from that stack.
- ``scrape_metrics(metrics_url) -> dict[str, float]``: a plain function (``from conftest import
  scrape_metrics``), also given as the fixture ``metrics_scraper``.
- ``wait_for(predicate, timeout_s)``: poll a condition with a deadline, for readiness checks in tests.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

MODEL_DIR = REPO_ROOT / "models" / "tiny-llama"

from client.metrics import parse_metrics, scrape_metrics  # noqa: E402  (re-exported for tests)

# The suite runs its servers as production should: tenants authenticated (scheduler/tenant_auth.py).
# Set here, every stack a test starts inherits it, and the client helpers (client.generate, the warmup
# job, perf_analyzer inputs) send the tokens of the tenants they name; tests of the unauthenticated
# mode pass TenantAuth() or an environment without it.
TENANT_SECRET = os.environ.setdefault("LLM_TENANT_SECRET", "ci-tenant-secret")

__all__ = ["parse_metrics", "scrape_metrics", "wait_for", "warm_stack"]


def warm_stack(run_dir: Path, **extra_env: str):
    """A stack of its own (Redis and tritonserver, warmed) with `extra_env` set for the servers: a
    context manager, for module fixtures of tests that need another configuration."""
    from deploy.launch import StackOptions, start_stack

    return start_stack(StackOptions(run_dir=run_dir, model_dir=MODEL_DIR, warmup=True, extra_env=extra_env))


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "stack" in getattr(item, "fixturenames", ()) or Path(str(item.fspath)).name.startswith(
            "test_server"
        ):
            item.add_marker(pytest.mark.server)


@pytest.fixture(scope="session")
def stack(tmp_path_factory):
    from deploy.launch import StackOptions, start_stack

    if not (MODEL_DIR / "config.json").exists():
        from engine.build_model import build

        build("tiny", MODEL_DIR)
    run_dir = tmp_path_factory.mktemp("stack")
    s = start_stack(StackOptions(run_dir=run_dir, model_dir=MODEL_DIR, warmup=True))
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="session")
def grpc_url(stack) -> str:
    return stack.grpc_url


@pytest.fixture(scope="session")
def http_url(stack) -> str:
    return stack.http_url


@pytest.fixture(scope="session")
def metrics_url(stack) -> str:
    return stack.metrics_url


@pytest.fixture(scope="session")
def redis_url(stack) -> str:
    return stack.redis_url


@pytest.fixture(scope="session")
def metrics_scraper():
    return scrape_metrics


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """A redis-server of our own on a free port (for store tests that need no tritonserver)."""
    from deploy.launch import find_free_port, start_redis_server

    port = find_free_port()
    proc, _ = start_redis_server("redis-server", tmp_path_factory.mktemp("redis"), port)
    try:
        yield f"redis://localhost:{port}/0"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def wait_for(predicate, timeout_s=30.0, interval_s=0.05):
    """Poll a condition with a deadline (a condition check, not a fixed sleep)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


def answer(text: str):
    """An exact-cache answer that ended (EOS), a token id per word of `text` (CRC-32 of the word, under
    2**16): for tests that store and read answers directly and compare what comes back."""
    import zlib

    from cache.response_cache import ExactAnswer

    return ExactAnswer(tuple(zlib.crc32(word.encode()) % 65536 for word in text.split()), 0, True)
