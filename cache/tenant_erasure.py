"""Delete one tenant's cached answers from Redis (an erasure request, or answers that must not be served
again after a policy change).

Exact and semantic entries carry the tenant's tag in their key names, across every model fingerprint,
so they can be found by pattern and deleted. KV snapshots (L3) cannot: a block's key is a hash chain
salted with the tenant, which no other tenant can produce or read, but nothing in the name says whose
it is; they expire by their TTL (`l3_ttl_s`, 24 h by default), which is the bound to set where that
matters. Replicas need no signal: a deleted exact key their key directory still lists costs one GET
and is forgotten, and a semantic tenant whose version key is gone is read again from Redis.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from cache.response_cache import KEY_PREFIX as EXACT_PREFIX
from cache.response_cache import tenant_tag
from cache.semantic_cache import KEY_PREFIX as SEMANTIC_PREFIX

SCAN_COUNT = 1000
DELETE_BATCH = 500


def tenant_patterns(tenant: str) -> dict[str, str]:
    """SCAN patterns of the tenant's entries per cache, for every model fingerprint."""
    tag = tenant_tag(tenant)
    return {
        "exact": f"{EXACT_PREFIX}:*:{tag}:*",
        "semantic": f"{SEMANTIC_PREFIX}:{{*:{tag}}}:*",  # the braces are the keys' hash tag, literal here
    }


@dataclass(frozen=True)
class Erasure:
    tenant: str
    keys: dict[str, int]  # per cache: keys found (and deleted unless dry_run)
    dry_run: bool


def _scan(client: Any, pattern: str) -> Iterator[bytes]:
    yield from client.scan_iter(match=pattern, count=SCAN_COUNT)


def erase_tenant(client: Any, tenant: str, dry_run: bool = False) -> Erasure:
    """Find (and unless `dry_run`, delete) the tenant's exact and semantic entries; raises redis errors."""
    if not tenant:
        raise ValueError("tenant is empty: name the tenant whose cached answers to delete")
    found: dict[str, int] = {}
    for cache, pattern in tenant_patterns(tenant).items():
        batch: list[bytes] = []
        count = 0
        for key in _scan(client, pattern):
            count += 1
            batch.append(key)
            if len(batch) >= DELETE_BATCH and not dry_run:
                client.unlink(*batch)
                batch = []
        if batch and not dry_run:
            client.unlink(*batch)
        found[cache] = count
    return Erasure(tenant, found, dry_run)
