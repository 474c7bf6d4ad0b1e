"""Delete what Redis holds for one tenant (an erasure request, or answers that must not be served again after
a policy change): its exact and semantic answers and its KV snapshots, for every model.

Exact and semantic entries carry the tenant's tag in their key names, so they are found by pattern
(so is an exact quota's index of the tenant's answers). A KV
block's name is a hash chain salted with the tenant, which says nothing about whose it is, so the engine
notes every block it writes in a per-tenant index (`RedisKVStore.tenant_index`: a sorted set scored by
expiry; indexes written as plain sets before are read too); the blocks listed there are deleted with it.
Each index is first renamed to one of the erasure's own, so that a block
written meanwhile starts a fresh index for the next erasure instead of being deleted from a set unread; a
renamed set that an interrupted erasure left is finished by the next. Blocks written before the index
existed, or whose index a bounded Redis evicted, go by their TTL (`l3_ttl_s`, 24 h). Answers and blocks
written while an erasure runs may stay: run it again once the tenant's traffic stopped. Replicas need no
signal: a deleted key their key directory still lists costs one GET and is forgotten, and a semantic
tenant whose version key is gone is read again. L1/L2 blocks live in the replicas' memory until evicted or
restarted.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from redis.crc import key_slot
from redis.exceptions import ResponseError

from cache.response_cache import INDEX_PREFIX as EXACT_INDEX_PREFIX
from cache.response_cache import KEY_PREFIX as EXACT_PREFIX
from cache.redis_topology import slot_groups
from cache.redis_kv_store import LEGACY_TENANT_INDEX_PREFIX, TENANT_INDEX_PREFIX
from cache.response_cache import tenant_tag
from cache.semantic_cache import KEY_PREFIX as SEMANTIC_PREFIX

SCAN_COUNT = 1000
DELETE_BATCH = 500
TAKEN = ":erasing:"  # an index set an erasure took over: `<index>:erasing:<id>`, same TTL


# Entries of earlier key formats are never read again and expire by their TTL, but hold the tenant's
# answers until then: an erasure deletes them too.
# Names as the earlier code wrote them: exact `llm:resp:exact:v1|v2:<fp>:<tag>:<hash>` (v2: max_tokens in
# the key), semantic `llm:resp:sem:v1|v2:{<fp>:<tag>}:emb|doc|age|ver` (v2: max_tokens in the signature,
# answers as text; the braces are the keys' hash tag, literal in a pattern)
LEGACY_PATTERNS = {
    "exact": ("llm:resp:exact:v1:*:{tag}:*", "llm:resp:exact:v2:*:{tag}:*"),
    "semantic": ("llm:resp:sem:v1:{{*:{tag}}}:*", "llm:resp:sem:v2:{{*:{tag}}}:*"),
}


def tenant_patterns(tenant: str) -> dict[str, tuple[str, ...]]:
    """SCAN patterns of the tenant's entries per cache, for every model fingerprint and key format."""
    tag = tenant_tag(tenant)
    current = {
        # the answers, and a quota's index of them
        "exact": (f"{EXACT_PREFIX}:*:{tag}:*", f"{EXACT_INDEX_PREFIX}:*:{tag}"),
        "semantic": (f"{SEMANTIC_PREFIX}:{{*:{tag}}}:*",),  # the braces are the keys' hash tag, literal here
    }
    return {
        cache: (*found, *(pattern.format(tag=tag) for pattern in LEGACY_PATTERNS[cache]))
        for cache, found in current.items()
    }


@dataclass(frozen=True)
class Erasure:
    tenant: str
    keys: dict[str, int]  # per cache: keys found (and deleted unless dry_run)
    dry_run: bool


def _scan(client: Any, pattern: str) -> Iterator[bytes]:
    yield from client.scan_iter(match=pattern, count=SCAN_COUNT)


def erase_tenant(client: Any, tenant: str, dry_run: bool = False) -> Erasure:
    """Find (and unless `dry_run`, delete) the tenant's exact and semantic entries and the KV blocks its
    index sets list; counts what existed, per cache. Raises redis errors."""
    if not tenant:
        raise ValueError("tenant is empty: name the tenant whose cached data to delete")
    found = {
        cache: sum(_remove(client, _scan(client, pattern), dry_run) for pattern in patterns)
        for cache, patterns in tenant_patterns(tenant).items()
    }
    blocks = 0
    tag = tenant_tag(tenant)
    for prefix in (TENANT_INDEX_PREFIX, LEGACY_TENANT_INDEX_PREFIX):
        left = list(_scan(client, f"{prefix}:*:{tag}{TAKEN}*"))  # by an erasure that failed
        for index in list(_scan(client, f"{prefix}:*:{tag}")) + left:
            listed = index if dry_run or index in left else _take(client, index)
            if listed is None:
                continue
            blocks += _remove(client, _members(client, listed), dry_run)
            if not dry_run:
                client.unlink(listed)
    found["l3"] = blocks
    return Erasure(tenant, found, dry_run)


def _members(client: Any, index: bytes) -> Iterator[bytes]:
    """The block names an index lists: a sorted set (v2) or a plain set (v1, written before)."""
    kind = client.type(index)
    if kind == b"zset":
        yield from (name for name, _ in client.zscan_iter(index, count=SCAN_COUNT))
    elif kind == b"set":
        yield from client.sscan_iter(index, count=SCAN_COUNT)


def _take(client: Any, index: bytes) -> bytes | None:
    """Move an index set to a name of this erasure's own, atomically, so that blocks an engine writes
    meanwhile start a fresh index (found by the next erasure) instead of joining a set about to be
    deleted unread. None when the set is already gone."""
    taken = _taken_name(index)
    try:
        client.rename(index, taken)
    except ResponseError as exc:
        if "no such key" in str(exc).lower():
            return None
        raise
    return taken


def _taken_name(index: bytes) -> bytes:
    """`<index>:erasing:<id>`, in the index's hash slot: a Redis Cluster (one master) refuses a RENAME
    across slots (CROSSSLOT). Where that name hashes elsewhere, the id carries the index's name as its
    hash tag."""
    unique = uuid.uuid4().hex.encode()
    plain = index + TAKEN.encode() + unique
    if key_slot(plain) == key_slot(index):
        return plain
    tagged = index + TAKEN.encode() + b"{" + index + b"}" + unique
    return tagged if key_slot(tagged) == key_slot(index) else plain


def _remove(client: Any, keys: Iterator[bytes], dry_run: bool) -> int:
    """Delete `keys` in batches (or count those that exist); returns how many existed."""
    existing, batch = 0, []
    for key in keys:
        batch.append(key)
        if len(batch) >= DELETE_BATCH:
            existing += _per_slot(client, batch, dry_run)
            batch = []
    if batch:
        existing += _per_slot(client, batch, dry_run)
    return existing


def _per_slot(client: Any, batch: list[bytes], dry_run: bool) -> int:
    """EXISTS (dry run) or UNLINK of `batch`, one command per hash slot in one round trip: a Redis Cluster
    (one master) refuses a multi-key command across slots (CROSSSLOT)."""
    pipe = client.pipeline(transaction=False)
    for group in slot_groups(batch):
        keys = [batch[i] for i in group]
        if dry_run:
            pipe.exists(*keys)
        else:
            pipe.unlink(*keys)
    return sum(pipe.execute())
