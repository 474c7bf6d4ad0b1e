"""A Redis that requires a password (as a production one does): every client the engine builds takes
the credentials from the URL, a wrong password makes the caches unavailable (a miss, never a failed
request), and the password never appears in what the commands print."""

from __future__ import annotations

import io
import subprocess
import uuid

import pytest
import redis
import torch

from cache.key_directory import KeyDirectory
from cache.redis_kv_store import RedisKVStore
from cache.response_cache import ExactResponseCache, redact_url
from cache.traffic_stats import TrafficStatsStore
from client.__main__ import main
from deploy.launch import find_free_port
from scheduler.messages import EngineRequestParams
from tests.conftest import wait_for, answer
from tests.test_cache_report import metrics_url  # noqa: F401  (the fixture)
from tests.test_redis_kv_store import META, _block, _keys

PASSWORD = "s3cret-" + uuid.uuid4().hex[:8]
GREEDY = EngineRequestParams(max_tokens=8)


def spawn_redis(run_dir, args: list[str], url: str) -> subprocess.Popen:
    """A redis-server of a test's own with `args` (auth, TLS), returned once a client of `url` gets a PONG."""
    proc = subprocess.Popen(
        ["redis-server", "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(run_dir),
         *args],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    client = redis.Redis.from_url(url)

    def answers() -> bool:
        try:
            return bool(client.ping())
        except (redis.ConnectionError, OSError):
            return False

    try:
        assert wait_for(answers, 10.0), f"redis-server {' '.join(args)} did not start"
    finally:
        client.close()
    return proc


@pytest.fixture(scope="module")
def auth_redis(tmp_path_factory):
    """A redis-server of its own that refuses clients without PASSWORD; its authenticated URL."""
    port = find_free_port()
    url = f"redis://:{PASSWORD}@127.0.0.1:{port}/0"
    args = ["--port", str(port), "--requirepass", PASSWORD]
    proc = spawn_redis(tmp_path_factory.mktemp("auth-redis"), args, url)
    yield url, port
    proc.terminate()
    proc.wait(timeout=10)


def exercise_every_client(url: str) -> None:
    """Every Redis client an engine builds (exact cache, key directory with its subscription, L3 store,
    traffic stats) does its work through `url`, with no error counted."""
    exact = ExactResponseCache(url, f"fp-{uuid.uuid4().hex[:8]}", timeout_s=0.5)
    namespace = f"test:kv:{uuid.uuid4().hex[:8]}"
    directory = KeyDirectory(url, namespace).start()
    store = RedisKVStore(url, namespace, timeout_s=0.5, directory=directory)
    traffic = TrafficStatsStore(url, "m", "fp")
    try:
        assert exact.put([1, 2], GREEDY, answer("hello")) and exact.get([1, 2], GREEDY) == answer("hello")
        assert wait_for(lambda: directory.synced, 10.0)
        keys = _keys(2)
        assert store.put_chain(keys, [_block(1), _block(2)], META, tenant="t") == 2
        torch.testing.assert_close(store.get(keys[1], META), _block(2))
        assert wait_for(lambda: directory.contains(store.redis_key(keys[0])) is True, 10.0)
        traffic.client.ping()
        assert exact.snapshot()["errors"] == 0 and store.stats.errors == 0
    finally:
        for closable in (exact, store, directory):
            closable.close()
        traffic.client.close()


def assert_unavailable_not_failing(url: str) -> str | None:
    """A cache behind `url` that cannot be reached as asked is a miss and counted errors, never an
    exception; returns the L3 store's last error, for the caller to check what it shows."""
    exact = ExactResponseCache(url, f"fp-{uuid.uuid4().hex[:8]}", timeout_s=0.5)
    store = RedisKVStore(url, f"test:kv:{uuid.uuid4().hex[:8]}", timeout_s=0.5)
    try:
        assert not exact.put([1, 2], GREEDY, answer("hello")) and exact.get([1, 2], GREEDY) is None
        assert store.put_chain(_keys(1), [_block(1)], META) == 0 and store.get(_keys(1)[0], META) is None
        assert exact.snapshot()["errors"] == 2 and store.stats.errors == 2
        return store.last_error
    finally:
        exact.close()
        store.close()


def test_every_cache_client_authenticates_from_the_url(auth_redis):
    exercise_every_client(auth_redis[0])


def test_a_wrong_password_is_an_unavailable_cache_not_an_error(auth_redis):
    _, port = auth_redis
    last_error = assert_unavailable_not_failing(f"redis://:not-{PASSWORD}@127.0.0.1:{port}/0")
    assert last_error and PASSWORD not in last_error


def check_the_commands(url: str, refused_url: str, scrape_url: str, secret: str) -> None:
    """`forget-tenant` and `cache` (reading `scrape_url`) work through `url`; through `refused_url`
    `cache` fails saying which Redis it could not read, redacted; `secret` is printed by neither."""
    out = io.StringIO()
    assert main(["forget-tenant", "nobody", "--redis-url", url], out=out) == 0
    assert "deleted 0 exact keys" in out.getvalue()
    assert main(["cache", "--metrics-url", scrape_url, "--redis-url", url], out=out) == 0
    out, err = io.StringIO(), io.StringIO()
    assert main(["cache", "--metrics-url", scrape_url, "--redis-url", refused_url], out=out, err=err) == 1
    assert f"cannot read {redact_url(refused_url)}" in err.getvalue() and "***@127.0.0.1" in err.getvalue()
    assert secret not in out.getvalue() + err.getvalue()


def test_the_commands_take_credentials_and_never_print_them(auth_redis, metrics_url):  # noqa: F811
    url, port = auth_redis
    check_the_commands(url, f"redis://:not-{PASSWORD}@127.0.0.1:{port}/0", metrics_url, PASSWORD)


@pytest.mark.parametrize(
    ("url", "shown"),
    [("redis://:pw@host:6379/0", "redis://***@host:6379/0"),
     ("rediss://user:pw@cache.internal:6380", "rediss://***@cache.internal:6380"),
     ("redis://localhost:6379/0", "redis://localhost:6379/0"),
     ("redis://:p@ss@host/1", "redis://***@host/1"),
     ("unix:///tmp/redis.sock", "unix:///tmp/redis.sock"),
     ("redis://host:6379/0?password=pw&db=1", "redis://host:6379/0?password=***&db=1"),
     ("rediss://:pw@host/0?ssl_ca_certs=/ca.crt&ssl_password=kp", "rediss://***@host/0?ssl_ca_certs=/ca.crt&ssl_password=***"),
     ("redis://host/0?socket_timeout=1", "redis://host/0?socket_timeout=1")],
)  # fmt: skip
def test_a_url_is_shown_without_its_credentials(url, shown):
    assert redact_url(url) == shown
