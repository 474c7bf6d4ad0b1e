"""Which Redis deployments the caches can use, checked once before they are built.

The stores reach Redis with plain (non-cluster) clients, multi-key Lua scripts and SCANs of one node.
A standalone Redis works, and so does a cluster whose hash slots are all served by one master (a
one-shard managed cluster). A cluster of several masters does not: keys on the other masters answer
MOVED, so every tier quietly turns into misses and counted errors, and `forget-tenant` would erase only
the connected master's share of a tenant. Such a Redis is refused up front, naming the problem. A Redis
that is down or failing over is not refused: that is an outage, which the tiers' circuit breakers
absorb, not a configuration to fix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from redis.crc import key_slot
from redis.exceptions import ClusterCrossSlotError


class UnsupportedRedis(ValueError):
    """The Redis at the configured URL is a deployment the caches cannot use correctly."""


@dataclass(frozen=True)
class RedisTopology:
    kind: str  # "standalone", "cluster" or "unknown" (Redis could not be asked)
    masters: int = 1  # masters serving slots; 1 for standalone
    state: str = "ok"  # cluster_state for a cluster
    detail: str = ""  # why the kind is unknown

    def describe(self) -> str:
        if self.kind == "cluster":
            return f"cluster, {self.masters} master serving slots (state {self.state})"
        return self.kind if not self.detail else f"{self.kind} ({self.detail})"


def parse_cluster_info(raw: bytes | str) -> dict[str, str]:
    """CLUSTER INFO's `field:value` lines (redis-py returns them as bytes from a plain client)."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)


def probe_topology(client) -> RedisTopology:
    """What `client`'s Redis is; raises UnsupportedRedis for a cluster the caches cannot use."""
    import redis

    try:
        if client.info("server").get("redis_mode") == "sentinel":
            raise UnsupportedRedis(
                "redis_url points at a Redis Sentinel, which answers no GET, SET or script: point it at "
                "the master the Sentinel names (SENTINEL get-master-addr-by-name)"
            )
        enabled = bool(client.info("cluster").get("cluster_enabled"))
        if not enabled:
            return RedisTopology("standalone")
        info = parse_cluster_info(client.execute_command("CLUSTER", "INFO"))
    except redis.ResponseError as exc:
        if "SELECT is not allowed in cluster mode" in str(exc):
            raise UnsupportedRedis(
                "redis_url names a database other than 0 on a Redis Cluster, which has only database 0: "
                "drop the /<db> from the URL"
            ) from exc
        return RedisTopology("unknown", detail=f"{type(exc).__name__}: {exc}")
    except (redis.RedisError, OSError) as exc:
        return RedisTopology("unknown", detail=f"{type(exc).__name__}: {exc}")
    topology = RedisTopology("cluster", int(info.get("cluster_size", "0")), info.get("cluster_state", "?"))
    if topology.masters > 1:
        raise UnsupportedRedis(
            f"redis_url points at a Redis Cluster of {topology.masters} masters: the caches use plain "
            "clients and multi-key scripts, so keys on the other masters would answer MOVED (every tier a "
            "miss) and forget-tenant would erase one master's share only. Use a standalone Redis (with "
            "replicas for failover) or a cluster with all its slots on one master"
        )
    return topology


def check_redis_url(redis_url: str, timeout_s: float = 1.0) -> RedisTopology:
    """`probe_topology` through a short-lived client of `redis_url`."""
    from cache.response_cache import make_redis_client

    client = make_redis_client(redis_url, timeout_s)
    try:
        return probe_topology(client)
    finally:
        client.close()


def slot_groups(names: Sequence[str | bytes]) -> list[list[int]]:
    """Positions of `names` grouped by Redis Cluster hash slot, in first-seen order: a cluster refuses a
    multi-key command across slots (CROSSSLOT), even when one master serves them all."""
    groups: dict[int, list[int]] = {}
    for i, name in enumerate(names):
        groups.setdefault(key_slot(name.encode() if isinstance(name, str) else name), []).append(i)
    return list(groups.values())


def is_cross_slot(exc: Exception) -> bool:
    """redis-py names the CROSSSLOT refusal ClusterCrossSlotError, without the code in its text."""
    return isinstance(exc, ClusterCrossSlotError) or "CROSSSLOT" in str(exc)
