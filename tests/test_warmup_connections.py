"""Warmup connects the request path's Redis clients, so that the first requests do not."""

from __future__ import annotations

from types import SimpleNamespace

import redis

from deploy.launch import find_free_port
from engine.warmup import open_connections


def _engine(response_client, semantic_client, l3_client):
    semantic = None if semantic_client is None else SimpleNamespace(client=semantic_client)
    return SimpleNamespace(
        responses=SimpleNamespace(cache=SimpleNamespace(client=response_client), semantic=semantic),
        prefix_cache=SimpleNamespace(l3=SimpleNamespace(store=SimpleNamespace(client=l3_client))),
    )


def test_the_clients_hold_an_open_connection_after_warmup(redis_server):
    clients = [redis.Redis.from_url(redis_server) for _ in range(3)]
    assert all(not c.connection_pool._available_connections for c in clients)  # lazy until first use
    assert open_connections(_engine(*clients)) == 3
    assert all(len(c.connection_pool._available_connections) == 1 for c in clients)


def test_an_unreachable_redis_is_skipped_not_raised(redis_server):
    dead = redis.Redis.from_url(f"redis://localhost:{find_free_port()}/0", socket_connect_timeout=0.2)
    alive = redis.Redis.from_url(redis_server)
    assert open_connections(_engine(alive, None, dead)) == 1
    assert open_connections(SimpleNamespace(responses=None, prefix_cache=None)) == 0
