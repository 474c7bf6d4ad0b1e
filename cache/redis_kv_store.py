"""L3: KV snapshots of prompt blocks in Redis, shared by all replicas of a model.

One Redis value per block, written with a single `SET key value EX ttl`, so a reader sees a whole
block or none (no header/payload pairs that can be half written). The value is the self-verifying
format of cache/kv_format.py; the key is `{namespace}:{block key hex}`, where the block key is the
SHA-256 chain of engine/prefix_cache.py (already salted with model fingerprint and tenant).

Redis is an optimisation, never a dependency: every call has a short socket timeout, no retries,
and goes through a circuit breaker, and every Redis error becomes a miss (None / False / 0) that is
counted. A damaged or foreign value is deleted, so it costs one failed load, not one per request.

Writes are announced on the namespace's channel; with a `KeyDirectory` (cache/key_directory.py), a
probe of blocks no replica has written is answered without a round trip.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from cache.circuit_breaker import CircuitBreaker
from cache.redis_full import FullGate
from cache.redis_topology import is_cross_slot, slot_groups
from cache.key_directory import (
    INDEX_DROPPED,
    KeyDirectory,
    adds_stamp,
    Written,
    renew_listed,
    write_announced,
)
from cache.kv_format import CorruptValue, IncompatibleValue, KVBlockMeta, decode_block, encode_block
from cache.response_cache import make_redis_client, redis_ttl, tenant_tag
from cache.wrong_type import DELETE_IF_UNCHANGED, DROP_OTHER_TYPE

T = TypeVar("T")
DEFAULT_TTL_S = 24 * 3600
# outside every block namespace: key directories never list it. v2: a sorted set scored by when each name
# expires, pruned on every write; v1 (a plain set, which kept expired names for as long as the tenant
# wrote) is still read by forget-tenant
TENANT_INDEX_PREFIX = "llm:kv-tenants:v2"
LEGACY_TENANT_INDEX_PREFIX = "llm:kv-tenants:v1"
# One command for a whole chain's probe: a pipeline of one EXISTS per block cost 476 us of Python at
# 128 blocks (83 at 16), on a thread that shares the GIL with the engine; this costs 115 (41).
_EXISTS_EACH = (
    "local found = {} for i, key in ipairs(KEYS) do found[i] = redis.call('EXISTS', key) end return found"
)


@dataclass
class KVStoreStats:
    hits: int = 0  # blocks loaded and verified
    misses: int = 0  # lookups that found no value (a chain counts once, where it stopped)
    stores: int = 0  # blocks written
    checksum_failures: int = 0  # damaged values (checksum, length, framing), deleted
    incompatible: int = 0  # intact values for another model/dtype/shape/layout/version, deleted
    errors: int = 0  # Redis errors and timeouts
    breaker_rejections: int = 0  # calls not sent because the breaker was open
    bytes_loaded: int = 0
    load_seconds: float = 0.0  # wall time of lookups that returned blocks (round trip + verify)
    bytes_stored: int = 0
    probes: int = 0  # exists_each calls that reached Redis: one round trip each
    probe_seconds: float = 0.0
    local_probes: int = 0  # exists_each calls the key directory answered without a round trip
    full_refusals: int = 0  # writes Redis refused for memory (maxmemory, nothing to evict): writes pause
    readonly_refusals: int = 0  # writes a read-only replica refused (a failover): writes pause too
    full_skips: int = 0  # writes not sent during such a pause
    quota_evictions: int = 0  # blocks deleted because their tenant was past `tenant_max_blocks`
    renewals: int = 0  # reused chains marked as just used in their tenant's index (with a quota)
    bad_indexes: int = 0  # tenant indexes that held another type: deleted, rebuilt by the write


def leading_run(present: Sequence[bool]) -> int:
    """How many of the first entries are True: the blocks a chain can load before its first gap."""
    run = 0
    for found in present:
        if not found:
            break
        run += 1
    return run


@dataclass(frozen=True)
class ChainWrite:
    stored: int  # SETs that took (less than asked: Redis unavailable or full)
    evicted: list[bytes]  # block keys the tenant's quota deleted, this write's own among them


class Chain(list):
    """`get_chain`'s blocks; `fetched`: how many values its round trip brought back (the leading run, and
    any found past a gap or a bad value), what the round trip's time was spent moving."""

    fetched: int = 0


class _Unavailable:
    """Marks a Redis call that did not happen or failed (distinct from a None reply)."""


_UNAVAILABLE = _Unavailable()


class RedisKVStore:
    def __init__(
        self,
        redis_url: str,
        namespace: str,
        ttl_s: int = DEFAULT_TTL_S,
        timeout_s: float = 0.05,
        breaker: CircuitBreaker | None = None,
        compress: bool = False,
        directory: KeyDirectory | None = None,
        tenant_max_blocks: int = 0,
    ):
        """`tenant_max_blocks` (> 0): the most blocks one tenant keeps here; its writes past that delete
        its own oldest, so a tenant's flood does not push other tenants' snapshots out of a full Redis."""
        if tenant_max_blocks < 0:
            raise ValueError(f"tenant_max_blocks must be >= 0 (0: no quota), got {tenant_max_blocks}")
        try:
            import redis
        except ImportError as exc:  # the engine decides whether to run without L3
            raise ImportError("RedisKVStore needs redis-py (pip install redis hiredis)") from exc
        self.namespace = namespace
        self.directory = directory
        self.ttl_s = redis_ttl(ttl_s)
        self.compress = compress
        self.tenant_max_blocks = tenant_max_blocks
        self.breaker = breaker if breaker is not None else CircuitBreaker()
        self.full = FullGate()
        # No retries: one timeout per call is the most a dead or slow Redis may cost a request.
        self.client = make_redis_client(redis_url, timeout_s)
        self._delete_if_unchanged = self.client.register_script(DELETE_IF_UNCHANGED)
        self._exists_each = self.client.register_script(_EXISTS_EACH)
        self._drop_other_type = self.client.register_script(DROP_OTHER_TYPE)
        self._redis_errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        self._lock = threading.Lock()
        self._stats = KVStoreStats()
        self._per_slot = False  # a one-master Redis Cluster: multi-key reads go one command per hash slot
        self._local = threading.local()  # failures per thread: a caller judges its own calls (prefetch)
        self.last_error: str | None = None

    @property
    def stats(self) -> KVStoreStats:
        """A consistent snapshot."""
        with self._lock:
            return dataclasses.replace(
                self._stats,
                full_refusals=self.full.refusals,
                readonly_refusals=self.full.readonly_refusals,
                full_skips=self.full.skips,
            )

    def redis_key(self, key: bytes) -> str:
        if not isinstance(key, bytes) or not key:
            raise TypeError(f"block keys are non-empty bytes, got {type(key).__name__}")
        return f"{self.namespace}:{key.hex()}"

    def put(self, key: bytes, tensor: torch.Tensor, meta: KVBlockMeta) -> bool:
        """Store one block; False when Redis is unavailable. A meta that does not fit raises ValueError."""
        return self.put_chain([key], [tensor], meta) == 1

    def tenant_index(self, tenant: str) -> str:
        """The sorted set of the block names written for `tenant`, scored by expiry: a block's name is a
        hash that does not say whose it is, and forgetting a tenant (`cache/tenant_erasure.py`) must find
        its blocks."""
        return f"{TENANT_INDEX_PREFIX}:{self.namespace}:{tenant_tag(tenant)}"

    def put_chain(
        self,
        keys: Sequence[bytes],
        tensors: Sequence[torch.Tensor],
        meta: KVBlockMeta,
        tenant: str | None = None,
    ) -> int:
        """Store blocks in one round trip (each SET atomic on its own); returns how many were stored (and
        not deleted by the tenant's quota in that round trip). `tenant`: whose blocks they are, noted in its
        index (`tenant_index`)."""
        written = self.write_chain(keys, tensors, meta, tenant)
        return written.stored - len(set(written.evicted) & set(keys))

    def write_chain(
        self,
        keys: Sequence[bytes],
        tensors: Sequence[torch.Tensor],
        meta: KVBlockMeta,
        tenant: str | None = None,
        head: Sequence[bytes] = (),
    ) -> ChainWrite:
        """`put_chain`, also naming the blocks the tenant's quota deleted (this write's own among them);
        `head`: the keys of the chain's blocks before `keys`, which the quota then keeps longer than
        these (`write_announced`)."""
        if len(keys) != len(tensors):
            raise ValueError(f"{len(keys)} keys for {len(tensors)} tensors")
        if not keys:
            return ChainWrite(0, [])
        values = [encode_block(t, meta, compress=self.compress, block=k) for t, k in zip(tensors, keys)]
        names = [self.redis_key(k) for k in keys]
        quota = 0 if tenant is None else self.tenant_max_blocks
        head_names = [self.redis_key(k) for k in head] if quota else []

        def op() -> Written:
            index = None if tenant is None else self.tenant_index(tenant)
            pairs = list(zip(names, values))
            return write_announced(self.client, self.namespace, pairs, self.ttl_s, index, quota, head_names)

        adds = adds_stamp(self.directory)  # before the trim: see below
        written = self._call(op, write=True)
        if isinstance(written, _Unavailable):
            return ChainWrite(0, [])
        gone = set(written.evicted)
        if self.directory is not None:
            # before this write's own add: a name the trim deleted that another replica wrote again since
            # (its announcement applied already) stays listed; the evicted may stay listed (one GET)
            for name in written.evicted:
                self.directory.discard(name, unless_added_since=adds)
            self.directory.add(name for name, r in zip(names, written.stored) if r and name not in gone)
        stored = sum(1 for r in written.stored if r)
        if written.trim_error is not None:
            self.last_error = f"tenant quota trim: {written.trim_error}"
        with self._lock:
            self._stats.errors += written.trim_error is not None
            self._stats.stores += stored
            self._stats.bytes_stored += sum(len(v) for v, r in zip(values, written.stored) if r)
            self._stats.quota_evictions += len(written.evicted)
            self._stats.bad_indexes += written.repaired_index
        prefix = f"{self.namespace}:"
        evicted = [bytes.fromhex(name[len(prefix) :]) for name in written.evicted if name.startswith(prefix)]
        return ChainWrite(stored, evicted)

    def renew(self, keys: Sequence[bytes], tenant: str) -> bool:
        """With a tenant quota: mark the tenant's blocks `keys` (a reused chain, head first) as just used,
        so its trims take them after blocks used longer ago (LRU by use, not by write); one round trip.
        False when there is no quota or Redis is unavailable."""
        if not self.tenant_max_blocks or not keys:
            return False
        names = [self.redis_key(k) for k in keys]

        reply = self._call(
            lambda: renew_listed(self.client, self.tenant_index(tenant), names, self.ttl_s), write=True
        )
        if isinstance(reply, _Unavailable):
            return False
        with self._lock:
            if reply == INDEX_DROPPED:
                self._stats.bad_indexes += 1
            else:
                self._stats.renewals += 1
        return reply != INDEX_DROPPED

    def get(self, key: bytes, meta: KVBlockMeta, device: str | torch.device = "cpu") -> torch.Tensor | None:
        """The verified block, or None on a miss, Redis trouble, an open breaker or a bad value."""
        chain = self.get_chain([key], meta, device=device)
        return chain[0] if chain else None

    def get_chain(
        self, keys: Sequence[bytes], meta: KVBlockMeta, device: str | torch.device = "cpu"
    ) -> list[torch.Tensor]:
        """The longest leading run of present, valid blocks of `keys`, fetched with one MGET."""
        if not keys:
            return []
        names = [self.redis_key(k) for k in keys]
        adds = adds_stamp(self.directory)  # before the MGET: see below
        start = time.perf_counter()
        values = self._call(lambda: self._mget(names))
        if isinstance(values, _Unavailable):
            return []
        blocks = Chain()
        blocks.fetched = sum(value is not None for value in values)
        loaded = 0
        bad: tuple[str, bytes] | None = None
        missing: str | None = None
        for key, name, value in zip(keys, names, values):
            if value is None:
                missing = name
                if self.directory is not None:  # unless a write may have landed since the MGET
                    self.directory.discard(name, unless_added_since=adds)
                break
            try:
                blocks.append(decode_block(value, meta, device=device, block=key))
            except CorruptValue as exc:
                self._count_bad("checksum_failures", exc)
                bad = (name, value)
                break
            except IncompatibleValue as exc:
                self._count_bad("incompatible", exc)
                bad = (name, value)
                break
            loaded += len(value)
        elapsed = time.perf_counter() - start
        with self._lock:
            self._stats.hits += len(blocks)
            self._stats.misses += int(missing is not None)
            if blocks:
                self._stats.bytes_loaded += loaded
                self._stats.load_seconds += elapsed
        if bad is not None:
            self.discard(*bad)
        if missing is not None:
            self._drop_if_wrong_type(missing)
        return blocks

    def count_miss(self) -> None:
        """A chain lookup a probe (`exists_each`) answered: Redis holds no block where the chain stops, and
        no GET was sent to find that out; counted as `get_chain` counts one it finds missing."""
        with self._lock:
            self._stats.misses += 1

    def _drop_if_wrong_type(self, name: str) -> None:
        """A block the caller's probe found and MGET did not: expired meanwhile, or a value of another type,
        which is deleted and counted (one round trip, on a path where the probe was wrong anyway): a
        block name holding a hash reads as missing to MGET while the probe's EXISTS finds it, so every
        lookup of its chain would pay for a load that finds nothing."""
        adds = adds_stamp(self.directory)  # a write after the DEL stays listed
        if self._call(lambda: self._drop_other_type(keys=[name], args=["string"])) == 1:
            self._count_bad("checksum_failures", TypeError(f"{name} held another Redis type"))
            if self.directory is not None:
                self.directory.discard(name, unless_added_since=adds)

    def discard(self, name: str, value: bytes) -> bool:
        """Delete the value at Redis key `name` if it still equals `value`; True when deleted."""
        adds = adds_stamp(self.directory)  # a write after the DEL stays listed
        deleted = self._call(lambda: self._delete_if_unchanged(keys=[name], args=[value])) == 1
        if deleted and self.directory is not None:  # spared (rewritten meanwhile): still there
            self.directory.discard(name, unless_added_since=adds)
        return deleted

    def exists_chain(self, keys: Sequence[bytes]) -> int:
        """How many leading blocks of `keys` are stored (without loading them); 0 on Redis trouble."""
        return leading_run(self.exists_each(keys) or [])

    def known_each(self, keys: Sequence[bytes]) -> list[bool] | None:
        """Whether each of `keys` is stored, from the key directory alone; None when it cannot tell."""
        if self.directory is None:
            return None
        found = self.directory.contains_each([self.redis_key(k) for k in keys])
        if found is not None:
            with self._lock:
                self._stats.local_probes += 1
        return found

    def exists_each(self, keys: Sequence[bytes]) -> list[bool] | None:
        """Whether each of `keys` is stored, from the key directory or in one round trip; None on Redis
        trouble."""
        if not keys:
            return []
        known = self.known_each(keys)
        return known if known is not None else self.exists_each_in_redis(keys)

    def exists_each_in_redis(self, keys: Sequence[bytes]) -> list[bool] | None:
        """`exists_each` asked of Redis alone, for a caller that already asked the key directory."""
        if not keys:
            return []
        names = [self.redis_key(k) for k in keys]
        started = time.perf_counter()
        found = self._call(
            lambda: self._by_slot(names, lambda client, part: self._exists_each(part, client=client))
        )
        if isinstance(found, _Unavailable):
            return None
        with self._lock:
            self._stats.probes += 1
            self._stats.probe_seconds += time.perf_counter() - started
        return [bool(n) for n in found]

    def close(self) -> None:
        if self.directory is not None:
            self.directory.close()
        try:
            self.client.close()
        except self._redis_errors:
            pass

    def _mget(self, names: list[str]) -> list[Any]:
        return self._by_slot(names, lambda client, part: client.mget(part))

    def _by_slot(self, names: list[str], read: Callable[[Any, list[str]], list[Any]]) -> list[Any]:
        """`read(client, names)`'s per-name replies; on a one-master Redis Cluster, which refuses a
        multi-key command across hash slots (CROSSSLOT), one command per slot, all in one round trip
        (learned from the first refusal, which is not a Redis failure)."""
        if not self._per_slot:
            try:
                return read(self.client, names)
            except self._redis_errors as exc:
                if not is_cross_slot(exc):
                    raise
                self._per_slot = True
        groups = slot_groups(names)
        pipe = self.client.pipeline(transaction=False)
        for group in groups:
            read(pipe, [names[i] for i in group])
        replies: list[Any] = [None] * len(names)
        for group, reply in zip(groups, pipe.execute()):
            for i, value in zip(group, reply):
                replies[i] = value
        return replies

    def _count_bad(self, counter: str, exc: Exception) -> None:
        with self._lock:
            setattr(self._stats, counter, getattr(self._stats, counter) + 1)
        self.last_error = f"{type(exc).__name__}: {exc}"

    def failures_on_this_thread(self) -> int:
        """Calls of this thread that failed or the breaker refused: the store-wide counts also move
        with other threads' calls (the L3 writer's), which must not end a caller's work."""
        return getattr(self._local, "failures", 0)

    def _failed_here(self) -> None:
        self._local.failures = self.failures_on_this_thread() + 1

    def _call(self, op: Callable[[], T], write: bool = False) -> T | _Unavailable:
        """Run one Redis operation through the breaker; errors are counted and never raised. A `write`
        also waits out a full or read-only Redis (`cache/redis_full.py`), whose refusal is not a breaker
        failure."""
        if write and not self.full.allow():  # first: a write not sent must not take the breaker's probe
            return _UNAVAILABLE
        if not self.breaker.allow():
            with self._lock:
                self._stats.breaker_rejections += 1
            self._failed_here()
            return _UNAVAILABLE
        try:
            result = op()
        except self._redis_errors as exc:
            self.last_error = f"{type(exc).__name__}: {exc}"
            # a read's script may write too (deleting a bad value): refused, it is a write refused
            if self.full.refused(exc):
                self.breaker.record_success()  # Redis answered: it is up, only full or read-only
                return _UNAVAILABLE
            self.breaker.record_failure()
            with self._lock:
                self._stats.errors += 1
            self._failed_here()
            return _UNAVAILABLE
        self.breaker.record_success()
        return result
