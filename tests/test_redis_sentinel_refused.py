"""A URL that names a Redis Sentinel (it answers PING and INFO, but no GET/SET/EVAL/SCAN) is reported as a
usable standalone Redis: every cache tier then turned into counted errors instead of being refused up front
(found in review, 2026-12-07)."""

from __future__ import annotations

import subprocess

import pytest
import redis

from cache.redis_topology import UnsupportedRedis, check_redis_url
from deploy.launch import find_free_port
from tests.conftest import wait_for


@pytest.fixture
def sentinel_url(tmp_path):
    port = find_free_port()
    conf = tmp_path / "sentinel.conf"
    conf.write_text(f"port {port}\nbind 127.0.0.1\ndir {tmp_path}\n")
    proc = subprocess.Popen(
        ["redis-server", str(conf), "--sentinel"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    client = redis.Redis(port=port)

    def answers():
        try:
            return bool(client.ping())
        except (redis.ConnectionError, OSError):
            return False

    try:
        assert wait_for(answers, 10.0)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        client.close()
        proc.terminate()
        proc.wait(timeout=10)


def test_a_sentinel_is_not_taken_for_a_standalone_redis(sentinel_url):
    client = redis.Redis.from_url(sentinel_url)
    with pytest.raises(redis.ResponseError):
        client.get("x")  # what every cache tier would send it
    client.close()
    try:
        topology = check_redis_url(sentinel_url)
    except UnsupportedRedis:
        return
    assert topology.kind != "standalone", topology
