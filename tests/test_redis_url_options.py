"""Query options of a redis_url (redis-py's from_url lets them override the keyword arguments the code
passes) must either be honoured without breaking the engine's guarantees, or be refused when the client
is built, naming the option (and never showing the password). Found in review, 2026-12-07."""

from __future__ import annotations

import os
import signal
import time
import uuid

import pytest

from cache.key_directory import KeyDirectory
from cache.redis_kv_store import RedisKVStore
from cache.redis_topology import check_redis_url
from cache.response_cache import ExactResponseCache, redact_url
from cache.traffic_stats import TrafficStatsStore
from deploy.launch import find_free_port
from scheduler.messages import EngineRequestParams
from tests.conftest import answer
from tests.test_redis_auth import spawn_redis
from tests.test_redis_kv_store import META, _block, _keys

GREEDY = EngineRequestParams(max_tokens=8)
SECRET = "pw-" + uuid.uuid4().hex[:8]


@pytest.fixture
def own_redis(tmp_path):
    """A redis-server of this test's own (it gets SIGSTOPped); its URL and pid."""
    port = find_free_port()
    url = f"redis://:{SECRET}@127.0.0.1:{port}/0"
    proc = spawn_redis(tmp_path, ["--port", str(port), "--requirepass", SECRET], url)
    yield url, proc.pid
    os.kill(proc.pid, signal.SIGCONT)
    proc.terminate()
    proc.wait(timeout=10)


def _build_or_refusal(build, option: str):
    """The client `build()` makes, or None when it refused the URL naming `option` (a fine answer)."""
    try:
        return build()
    except ValueError as exc:
        assert option in str(exc), f"refused without naming {option}: {exc}"
        assert SECRET not in str(exc)
        return None


def _timed(call) -> float:
    started = time.monotonic()
    call()
    return time.monotonic() - started


@pytest.mark.parametrize(
    "query",
    ["socket_timeout=5&socket_connect_timeout=5",  # the bug: the URL's 5 s replaced the engine's 50 ms
     "retry_on_timeout=true&health_check_interval=1"],  # fine today (kept as a guard): no second timeout
)  # fmt: skip
def test_url_options_do_not_stretch_a_lookup_on_a_stalled_redis(own_redis, query):
    """The request-path stores time out at 50 ms; options in the URL must not make a SIGSTOPped Redis
    stall a lookup for seconds (either the URL is refused naming the option or the bound still holds)."""
    url, pid = own_redis
    slow = f"{url}?{query}"
    option = query.partition("=")[0]
    store = _build_or_refusal(lambda: RedisKVStore(slow, f"t:kv:{uuid.uuid4().hex[:6]}", timeout_s=0.05),
                              option)  # fmt: skip
    exact = _build_or_refusal(lambda: ExactResponseCache(slow, f"fp{uuid.uuid4().hex[:6]}", timeout_s=0.05),
                              option)  # fmt: skip
    try:
        keys = _keys(1)
        if store is not None:
            assert store.put_chain(keys, [_block(1)], META, tenant="t") == 1  # a connection in the pool
        if exact is not None:
            assert exact.put([1, 2], GREEDY, answer("hello"))
        time.sleep(1.2)  # idle past a health_check_interval of 1 s: the next command PINGs first
        os.kill(pid, signal.SIGSTOP)
        try:
            if store is not None:
                took = _timed(lambda: store.get(keys[0], META))
                assert took < 1.0, f"an L3 lookup took {took:.2f} s on a stalled Redis (engine bound: 0.05 s)"
            if exact is not None:
                took = _timed(lambda: exact.get([1, 2], GREEDY))
                assert took < 1.0, f"an exact lookup took {took:.2f} s on a stalled Redis (bound: 0.05 s)"
        finally:
            os.kill(pid, signal.SIGCONT)
    finally:
        for closable in (store, exact):
            if closable is not None:
                closable.close()


@pytest.mark.parametrize("query", ["decode_responses=true", "decode_responses=false", "decode_responses=0"])
def test_decode_responses_in_the_url_is_refused_or_harmless(own_redis, query):
    """The stores parse bytes; a URL asking for decoded str must be refused up front, naming the option,
    or ignored: not a UnicodeDecodeError/AttributeError out of every lookup. (redis-py does not parse this
    option, so even `decode_responses=false` arrives as the truthy string 'false'.)"""
    url, _ = own_redis
    decoded = f"{url}?{query}"
    _build_or_refusal(lambda: check_redis_url(decoded), "decode_responses")
    store = _build_or_refusal(lambda: RedisKVStore(decoded, f"t:kv:{uuid.uuid4().hex[:6]}", timeout_s=0.5),
                              "decode_responses")  # fmt: skip
    exact = _build_or_refusal(lambda: ExactResponseCache(decoded, f"fp{uuid.uuid4().hex[:6]}", timeout_s=0.5),
                              "decode_responses")  # fmt: skip
    try:
        if store is not None:
            keys = _keys(1)
            assert store.put_chain(keys, [_block(1)], META, tenant="t") == 1
            assert store.get(keys[0], META) is not None
        if exact is not None:
            assert exact.put([1, 2], GREEDY, answer("hi")) and exact.get([1, 2], GREEDY) == answer("hi")
    finally:
        for closable in (store, exact):
            if closable is not None:
                closable.close()


@pytest.mark.parametrize(
    "query", ["single_connection_client=true", "retry_on_error=TimeoutError", "timeout=1", "socket_timout=1"]
)
def test_an_option_the_client_cannot_take_is_refused_when_built_not_at_the_first_command(own_redis, query):
    """redis-py hands unknown query names to the connection class, which raises TypeError on the first
    command: inside a lookup (an uncaught TypeError, not a Redis error), or the key directory's thread.
    The URL should be refused when the client is built, with a ValueError naming the option."""
    url, _ = own_redis
    option = query.partition("=")[0]
    bad = f"{url}?{query}"
    for build in (
        lambda: check_redis_url(bad),
        lambda: RedisKVStore(bad, "t:kv:x", timeout_s=0.5),
        lambda: ExactResponseCache(bad, "fpx", timeout_s=0.5),
        lambda: TrafficStatsStore(bad, "m", "fp"),
        lambda: KeyDirectory(bad, "t:kv:x"),
    ):
        with pytest.raises(ValueError, match=option) as refused:
            client = build()
            (getattr(client, "client", None) or client._client).ping()  # what a first command does
        assert SECRET not in str(refused.value)


def test_a_password_whose_query_name_is_percent_encoded_is_redacted():
    """redis-py decodes query names (parse_qs): `pass%77ord` is the password it sends; logs hide it."""
    shown = redact_url("redis://host:6379/0?pass%77ord=hunter2&db=1")
    assert "hunter2" not in shown
