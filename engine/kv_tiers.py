"""L3 behind the L1 prefix cache: KV snapshots of prompt blocks in Redis, shared by every replica.

On an L1 miss the chain continues in Redis; the cost model loads it only when moving the bytes is
predicted to beat recomputing the tokens (a slow Redis is often slower than prefill). New blocks
are copied to the host on the engine thread and written by a background thread, so Redis never
sits on a request's path. Redis trouble is absorbed by the store's circuit breaker.

`fetch` may run on two threads at once (the engine thread's lookups and the warmup's L3 prefetch,
engine/l3_prefetch.py): the store (redis-py's pooled client, locked stats), the circuit breaker and
the cost model are thread-safe, and this tier's own bookkeeping is under `_lock`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from cache.cost_model import LoadCostModel
from cache.kv_format import KVBlockMeta
from cache.redis_kv_store import ChainWrite, leading_run
from cache.stamps import Stamps
from engine.write_behind import WriteBehind

if TYPE_CHECKING:  # redis-py is imported only where the store is built (engine/loader.py)
    from cache.redis_kv_store import RedisKVStore

LAYOUT = "L2HBD-v1"  # [layers, 2 (k/v), kv_heads, block tokens, head_dim]
# an exploration (cache/cost_model.py) loads at most this many leading blocks and recomputes the rest:
# enough bytes to measure Redis (8 MB for the 1B model), few enough that the one request a period that
# explores stays within a few ms of its recompute
EXPLORE_BLOCKS = 16
OUTCOMES = ("loaded", "partial", "missing", "recompute")


@dataclass(frozen=True)
class _Write:
    keys: list[bytes]
    blocks: torch.Tensor  # [len(keys), ...] on the host
    tenant: str | None
    head: list[bytes]  # the chain's keys before `keys`


@dataclass(frozen=True)
class _Renewal:
    keys: list[bytes]  # reused blocks Redis holds, head first
    tenant: str


class L3Tier:
    def __init__(
        self,
        store: RedisKVStore,
        meta: KVBlockMeta,
        cost: LoadCostModel | None = None,
        backlog: int = 256,
        ttl_s: float = 86400.0,
        known_limit: int = 65536,
        clock=time.monotonic,
        renew_every_s: float = 60.0,
    ):
        self.store = store
        self.ttl_s = ttl_s
        self.clock = clock
        self._known: Stamps[bytes] = Stamps(known_limit)  # key -> when Redis was seen holding it
        self.renew_every_s = renew_every_s
        self._renewed: Stamps[bytes] = Stamps(known_limit)  # key -> when its renewal was queued
        self.republish_skipped = 0
        self.meta = meta
        self.cost = cost or LoadCostModel()
        self.block_bytes = (
            int(torch.Size(meta.shape).numel())
            * torch.empty((), dtype=getattr(torch, meta.dtype)).element_size()
        )
        self._writes: WriteBehind[_Write | _Renewal] = WriteBehind(self._write, "l3-writer", backlog)
        self.loaded_blocks = 0
        self.outcomes = dict.fromkeys(OUTCOMES, 0)  # chains asked, by what fetch_with_outcome answered
        self._lock = threading.Lock()  # _known and loaded_blocks: fetch may run on two threads
        self._probes = ThreadPoolExecutor(max_workers=1, thread_name_prefix="l3-probe")
        self.probe_wait_seconds = 0.0  # engine thread only
        self.probes_dropped = 0  # probes of requests that ended before their lookup, dropped unrun
        directory = getattr(store, "directory", None)
        if directory is not None:
            directory.on_scan(self._forget_unlisted)

    @property
    def writes_dropped(self) -> int:
        """Block writes given up because the writer had fallen behind (a slow Redis): never waited for."""
        return self._writes.dropped

    @property
    def writes_failed(self) -> int:
        """Writes that raised (a bug or a bad value, not Redis trouble, which the store absorbs): skipped."""
        return self._writes.failed

    def fetch(self, keys: list[bytes], present: Sequence[bool] | None = None) -> list[torch.Tensor]:
        """The leading blocks of `keys` found in Redis (on the host), or [] when recomputing is cheaper."""
        return self.fetch_with_outcome(keys, present)[0]

    def probe(self, keys: list[bytes]) -> Future[list[bool] | None]:
        """Ask Redis which of `keys` it holds, on the probe thread: started when a request arrives, the
        round trip overlaps its queueing and the engine's other work instead of sitting in its prefill.
        When the store's key directory can tell, the answer is ready at once, without a thread hop."""
        if (known := self.store.known_each(keys)) is not None:
            answered: Future[list[bool] | None] = Future()
            answered.set_result(known)
            return answered
        return self._probes.submit(self.store.exists_each_in_redis, keys)

    def drop_probe(self, probe: Future[list[bool] | None]) -> bool:
        """Drop the probe of a request that ends before its lookup (refused, cancelled, expired), unless
        the probe thread took it already: a queued one cost a round trip for nobody, and under a flood of
        refused requests delayed the probes of those that run. True when it was dropped (and counted)."""
        if probe.done() or not probe.cancel():  # answered, running, or cancelled by `close`
            return False
        with self._lock:  # refusals are dropped on the submitting threads, the rest on the engine's
            self.probes_dropped += 1
        return True

    def wait_probe(self, probe: Future[list[bool] | None]) -> list[bool] | None:
        """A probe's answer. None when the probe is still queued behind others (a slow Redis and a burst
        of arrivals): it is dropped and the caller asks Redis itself, so a request never waits for more
        than its own round trip. A probe that failed (Redis could not be asked, already a breaker
        failure) is a missing chain, [], not a second round trip that could time out again on the
        request's path. The wait is what the probe added to the request."""
        started = time.perf_counter()
        try:
            if probe.cancel():
                return None
            answer = probe.result()
            return [] if answer is None else answer
        except Exception:  # a failed probe is a missing chain: the request recomputes
            return []
        finally:
            self.probe_wait_seconds += time.perf_counter() - started

    def fetch_with_outcome(
        self, keys: list[bytes], present: Sequence[bool] | None = None
    ) -> tuple[list[torch.Tensor], str]:
        """`fetch`, and why it returned what it did: "missing" (Redis holds no leading block, or could
        not be asked), "recompute" (the cost model chose to recompute), "loaded" (every block Redis
        held), "partial" (some of them were corrupt, incompatible or gone by the GET). `present`: what
        a `probe` already learned about `keys`, so the round trip is not made again here. Each chain
        asked is counted by outcome (`outcomes`): L3's hit rate is over chains, served or not."""
        blocks, outcome = self._fetch(keys, present)
        if keys:
            with self._lock:
                self.outcomes[outcome] += 1
        return blocks, outcome

    def _fetch(self, keys: list[bytes], present: Sequence[bool] | None) -> tuple[list[torch.Tensor], str]:
        if not keys:
            return [], "missing"
        if present is None:
            failed_before = _failures_here(self.store)
            available = self.store.exists_chain(keys)
            answered = _failures_here(self.store) == failed_before
        else:  # a failed probe is [] (`wait_probe`)
            available, answered = leading_run(present), len(present) > 0
        available = min(available, len(keys))
        self._remember(keys[:available])
        self._forget(keys[available:])  # not there (lost, evicted, expired, never written): may be written
        # Redis said where the chain stops: its miss, which the GET the probe spared would have counted
        gap = answered and available < len(keys)
        if available == 0:
            if gap:
                self._count_miss()
            return [], "missing"
        decision = self.cost.decide(available * self.meta.token_count, available * self.block_bytes)
        if decision == "recompute":
            return [], "recompute"
        asked = available  # the probe's leading run, before an exploration cuts it
        if decision == "explore":  # a measurement, not a win: its request pays for a few blocks at most
            available = min(available, EXPLORE_BLOCKS)
        failed_before = _failures_here(self.store)
        started = time.perf_counter()
        blocks = self.store.get_chain(keys[:available], self.meta)
        elapsed = time.perf_counter() - started
        with self._lock:
            for key in keys[len(blocks) : available]:  # rejected (corrupt, incompatible) and deleted
                self._known.pop(key)
            self.loaded_blocks += len(blocks)
        if blocks:  # the round trip moved every value it found, not only the leading run's
            fetched = max(len(blocks), getattr(blocks, "fetched", 0))
            self.cost.observe_load(fetched * self.block_bytes, elapsed)
        else:  # a GET that went out and timed out is what loading costs now (an exploration's look too)
            failed = _failures_here(self.store) != failed_before
            measured = failed and self.cost.observe_failed_load(available * self.block_bytes, elapsed)
            if decision == "explore" and not measured:
                self.cost.explored_nothing()
        if not blocks:  # every block rejected (corrupt, incompatible), gone by the GET or Redis failed:
            return [], "missing"  # nothing served, not a hit of the chain
        if gap and len(blocks) == asked:  # the load reached the gap the probe found: its miss
            self._count_miss()
        return blocks, "loaded" if len(blocks) == available else "partial"

    def _count_miss(self) -> None:
        """A chain that stopped where Redis holds no block, as `RedisKVStore.get_chain` counts one."""
        count = getattr(self.store, "count_miss", None)
        if count is not None:
            count()

    def publish(
        self,
        keys: list[bytes],
        blocks: torch.Tensor,
        tenant: str | None = None,
        head: list[bytes] | None = None,
    ) -> None:
        """Queue blocks [n, ...] for Redis; when the writer falls behind, drop rather than wait.
        `tenant`: whose blocks they are (noted in Redis, so that forgetting a tenant finds them); `head`:
        the keys of the chain's blocks before these, which a tenant quota keeps longer than these.

        Blocks Redis was recently seen holding (a chain recomputed because that was cheaper than
        loading it) are not written again: the device-to-host copy and the rewrite would only compete
        with requests, typically right after start-up when a new replica warms its hot prefixes.
        """
        fresh = self.unknown(keys)
        self.republish_skipped += len(keys) - len(fresh)
        # one write per run of fresh blocks, the known ones before it its head: a skipped block between
        # two runs is the later run's head, renewed above it, so a quota trims that tail before it
        for start, end in _runs(fresh):
            run = keys[start:end]
            self._remember(run)  # before the write is queued: the writer forgets them if it fails
            written = _Write(
                run, blocks[start:end].to("cpu", copy=True), tenant, [*(head or []), *keys[:start]]
            )
            if not self._writes.submit(written):
                self._forget(run)

    @property
    def renews(self) -> bool:
        """Whether reuses are worth telling Redis about: only a tenant quota reads the index's scores."""
        return bool(getattr(self.store, "tenant_max_blocks", 0))

    def renew(self, keys: list[bytes], tenant: str) -> None:
        """Queue a renewal of reused blocks Redis holds (`RedisKVStore.renew`), each at most once per
        `renew_every_s`: a tenant quota then trims by last use, so a hot head that replicas serve from
        L1, and so never write again, is not trimmed as the oldest block. Dropped when the writer is
        behind."""
        if not keys or not self.renews:
            return
        now = self.clock()
        due_before = now - self.renew_every_s
        with self._lock:
            # the keys up to the last one due, not only those due: a renewed tail must not outrank its head
            due_at = self._renewed.stale(keys, due_before)
            due = keys[: due_at[-1] + 1] if due_at else []
            self._renewed.stamp(due, now)
        if due:
            self._writes.submit(_Renewal(due, tenant))

    def _write(self, item: _Write | _Renewal) -> None:
        """The writer thread's write; blocks it could not store (Redis down, full, the breaker open) are
        forgotten, so that the next store of them publishes them again instead of skipping them for hours,
        and so are blocks the tenant's quota deleted, this write's or older ones."""
        if isinstance(item, _Renewal):
            self.store.renew(item.keys, item.tenant)
            return
        written = ChainWrite(0, [])
        try:
            written = self.store.write_chain(
                item.keys, list(item.blocks.unbind(0)), self.meta, item.tenant, item.head
            )
        finally:  # a write that raised is counted by the writer, and its blocks forgotten here
            if written.stored < len(item.keys):
                self._forget(item.keys)
            self._forget(written.evicted)

    def unknown(self, keys: list[bytes]) -> list[int]:
        """Positions of the keys Redis is not known to hold (what `publish` would write): not seen
        there within half the TTL, after which Redis may have expired them. Called on every prefix
        lookup, so one lock and one clock read for the whole chain."""
        fresh_after = self.clock() - self.ttl_s / 2
        with self._lock:
            return self._known.stale(keys, fresh_after)

    def _forget(self, keys: list[bytes]) -> None:
        with self._lock:
            for key in keys:
                self._known.pop(key)

    def _forget_unlisted(self, listed: set[str]) -> None:
        """A key directory's scan: blocks remembered as held that Redis no longer lists (it restarted
        empty, evicted them, was flushed) are forgotten, so the next reuse of them writes them again
        instead of skipping them for up to half the TTL. On the directory's thread, every `rescan_s`; a
        block written while the scan ran may be forgotten too, which costs one write more."""
        with self._lock:
            remembered = self._known.keys()
        gone = [key for key in remembered if self.store.redis_key(key) not in listed]
        self._forget(gone)

    def _remember(self, keys: list[bytes]) -> None:
        now = self.clock()
        with self._lock:
            self._known.stamp(keys, now)

    def close(self) -> None:
        self._probes.shutdown(wait=False, cancel_futures=True)
        self._writes.close()
        self.store.close()


def _failures_here(store) -> int:
    """The store's failed calls on this thread (a store without that count: none)."""
    count = getattr(store, "failures_on_this_thread", None)
    return 0 if count is None else count()


def _runs(positions: list[int]) -> list[tuple[int, int]]:
    """Ascending positions as (start, end) runs of consecutive ones."""
    runs: list[tuple[int, int]] = []
    for position in positions:
        if runs and runs[-1][1] == position:
            runs[-1] = (runs[-1][0], position + 1)
        else:
            runs.append((position, position + 1))
    return runs
