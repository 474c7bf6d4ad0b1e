"""L1 prefix cache: keys/values of full prompt blocks, kept in a pool allocated once on the device.

A prompt is cut into blocks of `block_size` tokens; each block's key is a SHA-256 chain over
(parent key, block tokens) seeded with a salt of the model fingerprint and the tenant, so keys
are identical across processes and machines (no Python `hash()`) and tenants never share KV.
A request reuses the longest cached chain of its prompt and computes only the rest. Eviction is
LRU over unpinned blocks, and a lookup refreshes a chain tail-first, so the tails of long
prefixes go before the shared heads. Warmed templates can be pinned, up to half the pool: a pool
full of pinned blocks could admit nothing new.

Every reuse is timed per tier that served it (L1: the copy into the slot; L2 and L3: fetching and
promoting the blocks plus their share of that copy) and compared with the predicted recompute time
of its tokens (`ReuseLedger`): the time saved, and for loads slower than recomputing, the time lost.
The copy is timed on the host clock without a device sync, so on a GPU it is the launch, not the DMA.

Blocks fetched from L3 on another thread (the warmup's prefetch of hot prefixes, engine/l3_prefetch.py)
enter through `adopt` on the engine thread: the only thread that touches the pool. `chain_keys` is
pure and may be called from any thread.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from cache.cost_model import LoadCostModel, ReuseLedger
from cache.sightings import Sightings
from engine.block_rows import copy_rows, select
from engine.kv_tiers import L3Tier
from engine.l2_pool import HostBlockPool
from engine.model_runner import ModelRunner


def pin_room(capacity: int, pinned: set[bytes]) -> int:
    """How many more blocks a pool of `capacity` may pin: half of it at most, since a pool full of
    pinned blocks could admit nothing new (L1 and L2 alike)."""
    return max(0, capacity // 2 - len(pinned))


@contextmanager
def one_host_thread(device: torch.device) -> Iterator[None]:
    """Run the host copies of a store on the calling thread alone. They are small (a prompt's blocks,
    ~1 MB) and run while Triton's other threads send the first token: spread over 2 OpenMP threads,
    one of them often waits for a busy core. Measured on the 2-core CI VM with one core busy: store mean
    1.1-1.2 ms with 2 threads (median 0.3), 0.35 ms with one. On a GPU the copies are device work."""
    threads = torch.get_num_threads()
    if device.type != "cpu" or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def block_keys(
    tokens: Sequence[int], block_size: int, salt: bytes, parent: bytes | None = None
) -> list[bytes]:
    """Chained keys of the full blocks of `tokens`; `parent`: the key of the block just before them
    (None: they begin the prompt), to continue a chain already hashed."""
    keys = []
    parent = parent if parent is not None else hashlib.sha256(b"prefix-v1|" + salt).digest()
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = struct.pack(f"<{block_size}q", *tokens[start : start + block_size])
        parent = hashlib.sha256(parent + block).digest()
        keys.append(parent)
    return keys


@dataclass
class PrefixHint:
    """Work on a prompt's prefix done when the request arrives, off the engine thread: its chain keys
    (hashing a long prompt takes a while), and the L3 probe of which of them Redis holds (a round trip)."""

    keys: list[bytes]
    probe: Future[list[bool] | None] | None = None


class PrefixCache:
    def __init__(
        self,
        runner: ModelRunner,
        capacity_blocks: int,
        block_size: int,
        fingerprint: str,
        clock: Callable[[], float] = time.perf_counter,
        cost: LoadCostModel | None = None,
        sightings: int | None = None,
    ):
        """`cost` prices reuses while there is no L3 (see `cost`); `clock` times them (tests inject one);
        `sightings`: how many stored blocks to remember for "on reuse" (default 8 pools' worth)."""
        self.runner = runner
        self.block_size = block_size
        self.fingerprint = fingerprint.encode()
        shape = runner.shape
        self.pool = torch.zeros(
            (capacity_blocks, shape.layers, 2, shape.kv_heads, block_size, shape.head_dim),
            dtype=runner.dtype,
            device=runner.device,
        )
        self.index: OrderedDict[bytes, int] = OrderedDict()  # LRU order: oldest first
        self.free = list(range(capacity_blocks - 1, -1, -1))
        self.pinned: set[bytes] = set()
        # every block of a warmed template (stored with `pin`, or adopted), pinned here or not: past
        # L1's pin room, a template's blocks are demoted like any other, and pinned in L2 instead.
        # Each maps to (its parent in the chain or None, its position): L2 pins a block only behind a
        # pinned parent, so that its pin room goes head first although L1 demotes tails first
        self.warmed: dict[bytes, tuple[bytes | None, int]] = {}
        self.evictions = 0
        self.hit_blocks = 0
        # blocks a lookup asked a tier for that it did not hold (a prompt's chain past L1's, then past
        # L2's, leading run): with hit_blocks, each tier's block hit rate
        self.miss_blocks = 0
        self.l2_miss_blocks = 0
        self.lookup_seconds = 0.0  # what the cache costs every request, hit or not (host clock)
        self.store_seconds = 0.0
        # the stores' own CPU time (the thread's clock): against store_seconds, what they waited (the GIL,
        # a descheduled thread) apart from what they computed
        self.store_cpu_seconds = 0.0
        # exceptions a tier raised (a bug, a device or host memory failure; Redis errors are the store's
        # own): the lookup keeps the prefix found so far, the store or demotion is dropped, the request
        # computes the rest. One tier's failure must not end the request, nor every running one.
        self.tier_errors = 0
        self.last_tier_error: str | None = None
        self.log: Callable[[str], None] = lambda message: None  # the engine's logger, set by the loader
        self.l2: HostBlockPool | None = None
        self._protected: set[bytes] = set()
        self.l3: L3Tier | None = None
        self.clock = clock
        self.savings = ReuseLedger()
        self._own_cost = cost or LoadCostModel()
        self._pending: list[tuple[str, int, float]] = []  # (tier, blocks, fetch seconds) of the last lookup
        self._reused: list[tuple[bytes, str]] = []  # (key, tenant) reused since the last store, for L3
        self.publish_on_first_use = False  # L3 write policy: every new block, or (default) on reuse
        self._seen: Sightings[bytes] = Sightings(sightings or max(4096, 8 * capacity_blocks))  # by tenant
        # Set by `adopt`, consumed by the next lookup: the adopted keys (booked as L3 reuse, with the
        # engine thread's wait + promote seconds) and every key L3 was already asked about.
        self._adopted: tuple[set[bytes], float, set[bytes]] = (set(), 0.0, set())

    @property
    def capacity(self) -> int:
        return self.pool.shape[0]

    @property
    def bytes(self) -> int:
        return self.pool.numel() * self.pool.element_size()

    @property
    def cost(self) -> LoadCostModel:
        """The cost model whose prefill estimate prices a reuse: L3's (the engine feeds it measured
        prefills) when there is an L3, else this cache's own, which stays at its prior until fed."""
        return self.l3.cost if self.l3 is not None else self._own_cost

    def salt(self, tenant: str) -> bytes:
        return self.fingerprint + b"|tenant=" + tenant.encode()

    def chain_keys(self, tokens: Sequence[int], tenant: str) -> list[bytes]:
        """Keys of the blocks `lookup` may reuse: the full blocks of `tokens`, >= 1 token left to compute."""
        usable = (len(tokens) - 1) // self.block_size
        return block_keys(tokens[: usable * self.block_size], self.block_size, self.salt(tenant))

    def hint(self, tokens: Sequence[int], tenant: str) -> PrefixHint:
        """Start a request's prefix work on the calling thread (the one that queues it), for `lookup`.

        The L3 probe is skipped when L1 holds the whole chain. That glance at the index from another
        thread may be stale by the time of the lookup; then the lookup asks Redis itself, as without
        a hint, so a stale glance costs time, never a wrong block."""
        keys = self.chain_keys(tokens, tenant)
        hint = PrefixHint(keys)
        if self.l3 is not None and keys and not all(key in self.index for key in keys):
            hint.probe = self.l3.probe(keys)
        return hint

    def lookup(self, tokens: Sequence[int], tenant: str, hint: PrefixHint | None = None) -> list[int]:
        """Pool indices of the longest cached prefix; at least one prompt token is left to compute.
        `hint`: what `hint` started for these tokens and this tenant when the request arrived."""
        started = self.clock()
        try:
            return self._lookup(tokens, tenant, hint)
        finally:
            self.lookup_seconds += self.clock() - started

    def _lookup(self, tokens: Sequence[int], tenant: str, hint: PrefixHint | None) -> list[int]:
        keys = hint.keys if hint is not None else self.chain_keys(tokens, tenant)
        adopted, adopted_s, asked = self._adopted
        self._adopted = (set(), 0.0, set())
        found: list[bytes] = []
        for key in keys:
            if key not in self.index:
                break
            found.append(key)
        from_l3 = sum(1 for key in found if key in adopted)  # fetched by the prefetch, adopted just now
        self.hit_blocks += len(found) - from_l3
        self.miss_blocks += len(keys) - len(found)
        self._pending = [("l1", len(found) - from_l3, 0.0)]
        if from_l3:
            self._pending.append(("l3", from_l3, adopted_s))
        self._protected = set(found)  # promoting the rest of the chain must not evict its head
        try:
            if self.l2 is not None:
                started = self.clock()
                rest = keys[len(found) :]
                promoted = self._guarded("l2 lookup", lambda: self._from_l2(rest))
                self._pending.append(("l2", len(promoted), self.clock() - started))
                found += promoted
            # L3 is asked for no more blocks than L1 has rows for: rows neither pinned nor holding the
            # prefix found so far. A block fetched past that is dropped, its GET and checksum wasted and
            # counted as an L3 hit it never was
            if (
                self.l3 is not None
                and len(found) < len(keys)
                and keys[len(found)] not in asked
                and (room := self.capacity - len(self.pinned | self._protected)) > 0
            ):
                started = self.clock()
                rest = keys[len(found) : len(found) + room]
                promoted = self._guarded("l3 lookup", lambda: self._promote_l3(rest, hint, len(found)))
                self._pending.append(("l3", len(promoted), self.clock() - started))
                found += promoted
        finally:
            self._protected = set()
        for key in reversed(found):  # the head ends most recent: tails are evicted first
            self.index.move_to_end(key)
        self._reused += [(key, tenant) for key in found]  # to L3 by the next store, after the first token
        return [self.index[key] for key in found]

    def _promote_l3(self, rest: list[bytes], hint: PrefixHint | None, skip: int) -> list[bytes]:
        """The blocks of `rest` (the chain past its first `skip` blocks) that L3 holds, in L1."""
        present = None if hint is None or hint.probe is None else self.l3.wait_probe(hint.probe)
        if present:  # [] is a failed probe
            present = present[skip : skip + len(rest)]
        return self._promote(rest, self.l3.fetch(rest, present))

    def _guarded(self, where: str, promote: Callable[[], list[bytes]]) -> list[bytes]:
        """A lookup stage whose failure is a miss of that tier: the prefix found so far stands."""
        try:
            return promote()
        except Exception as exc:
            self._tier_failed(where, exc)
            return []

    def load(self, slot: int, indices: list[int]) -> int:
        """Copy cached blocks into the start of `slot`; returns the number of tokens loaded.

        `indices` is what the last `lookup` returned; the reuse is booked per tier that served it."""
        started = self.clock()
        self.runner.write_blocks(slot, self.pool[self._rows(indices)])
        copy_s = self.clock() - started
        pending, self._pending = self._pending, []
        if sum(blocks for _, blocks, _ in pending) != len(indices):  # not the last lookup's result
            pending = [("l1", len(indices), 0.0)]
        for tier, blocks, fetch_s in pending:
            if blocks:
                tokens = blocks * self.block_size
                load_s = fetch_s + copy_s * blocks / len(indices)
                self.savings.record(tier, tokens, self.cost.predict_prefill_s(tokens), load_s)
        return len(indices) * self.block_size

    def store(
        self,
        slot: int,
        tokens: Sequence[int],
        tenant: str,
        pin: bool = False,
        publish: bool = False,
        head: list[bytes] | None = None,
    ) -> int:
        """Keep the full blocks of `tokens` (already in `slot`) that are not cached yet; returns how many.

        New blocks go to L3 at once only when `publish` (warmup traffic), `pin` (hot templates) or
        `publish_on_first_use`; otherwise a block is written when it is reused: hit in L1/L2 (written
        by the store after the `lookup` that found it) or stored a second time after an eviction.
        One-off prompts, most of the traffic at a low hit rate, then cost no host copy and no Redis
        write. `head`: the keys of `tokens`' leading blocks, already hashed for this tenant (a
        `PrefixHint`'s); only the rest is hashed here.
        """
        started, cpu = self.clock(), time.thread_time()
        try:
            with one_host_thread(self.pool.device):
                self._publish_reused()
                return self._store(slot, tokens, tenant, pin, publish, head or [])
        except Exception as exc:  # a cache that fails to keep a prompt costs a later recompute, no more
            self._tier_failed("store", exc)
            return 0
        finally:
            self.store_seconds += self.clock() - started
            self.store_cpu_seconds += time.thread_time() - cpu

    def _tier_failed(self, where: str, exc: Exception) -> None:
        error = f"{type(exc).__name__}: {exc}"
        self.tier_errors += 1
        self.last_tier_error = f"{where}: {error}"
        self.log(json.dumps({"event": "cache_tier_error", "where": where, "error": error}))

    def _store(
        self, slot: int, tokens: Sequence[int], tenant: str, pin: bool, publish: bool, head: list[bytes]
    ) -> int:
        rest = tokens[len(head) * self.block_size :]
        keys = head + block_keys(rest, self.block_size, self.salt(tenant), head[-1] if head else None)
        missing = [i for i, key in enumerate(keys) if key not in self.index]
        if not missing and not (pin or publish):
            return 0
        stored: list[int] = []
        if missing:
            blocks = self.runner.read_blocks(slot, missing[-1] + 1, self.block_size)
            stored = self._keep(keys, missing, blocks)
        if pin:
            self._warm([key for key in keys if key in self.index], keys)
        if self.l3 is None:
            return len(stored)
        if publish or pin:  # warmup and templates: all of the chain L1 holds, not only what this store added
            held = list(itertools.takewhile(self.index.__contains__, keys))
            if self.l3.unknown(held):
                self.l3.publish(held, self.pool[self._rows([self.index[key] for key in held])], tenant)
        elif stored:
            if self.publish_on_first_use:
                second = stored
            else:  # computed again: seen before
                seen = self._seen.seen_many([keys[i] for i in stored], tenant)
                second = [i for i, again in zip(stored, seen) if again]
            if second:
                self.l3.publish([keys[i] for i in second], blocks[second], tenant, keys[: second[0]])
        return len(stored)

    def _keep(self, keys: list[bytes], missing: list[int], blocks: torch.Tensor) -> list[int]:
        """Copy the `missing` blocks of the chain `keys` (rows of `blocks`) into L1; returns the positions
        stored (fewer when the pool has too few rows that may be evicted)."""
        # never evict a block of the chain being stored (its head, say): the blocks stored after it would
        # sit in L1 unreachable, since a lookup stops at the first block it lacks
        saved, self._protected = self._protected, self._protected | set(keys)
        try:
            indices = self._allocate(len(missing))
        finally:
            self._protected = saved
        stored = missing[: len(indices)]
        if indices:  # new rows are the evicted ones once the pool is full: often 2-3 runs, a copy each
            with self._freed_on_failure(indices):
                copy_rows(self.pool, indices, blocks, stored)
            for i, index in zip(stored, indices):
                self.index[keys[i]] = index
        for key in reversed(keys):  # as in lookup: the head ends most recent, so tails are evicted first
            if key in self.index:
                self.index.move_to_end(key)
        return stored

    def _publish_reused(self) -> None:
        """Blocks reused since the last store are worth sharing with other replicas: write those Redis
        lacks (and L1 still holds); a resumed request's lookup is followed by no store of its own. Done
        by the store after the first token, not in the lookup: the host copy, and the writer thread's
        encoding and checksums beside it, made a first hit's prefill 1.7x slower on the CPU (59 vs 35
        ms at 2000 tokens)."""
        reused, self._reused = dict.fromkeys(self._reused), []
        for tenant in dict.fromkeys(tenant for _, tenant in reused):  # one write per tenant: its index
            keys = [key for key, owner in reused if owner == tenant and key in self.index]
            fresh = self.l3.unknown(keys) if self.l3 is not None else []
            if fresh:
                indices = self._rows([self.index[keys[i]] for i in fresh])
                self.l3.publish([keys[i] for i in fresh], self.pool[indices], tenant)
            if self.l3 is not None and self.l3.renews:  # with a tenant quota: trimmed by last use
                new = set(fresh)
                self.l3.renew([key for i, key in enumerate(keys) if i not in new], tenant)

    def adopt(self, keys: list[bytes], blocks: list[torch.Tensor], waited_s: float = 0.0) -> int:
        """Bring host blocks fetched from L3 on another thread into L1, pinned as templates are.

        `keys` are all the keys L3 was asked about (`chain_keys` of one prompt), `blocks` the leading
        run it returned. The next `lookup` finds them in L1, books them as L3 reuse (`waited_s`, the
        engine thread's wait for the fetch, plus the promote time) and does not ask L3 again about
        `keys`. Returns the number of blocks added (keys already cached keep their blocks)."""
        started = self.clock()
        todo = [(key, block) for key, block in zip(keys, blocks) if key not in self.index]
        self._protected = {key for key in keys if key in self.index}
        try:
            promoted = self._promote([key for key, _ in todo], [block for _, block in todo])
        finally:
            self._protected = set()
        self._warm([key for key in keys if key in self.index], keys)  # a head L1 held already included
        for key in reversed(keys):  # as in lookup: the head ends most recent
            if key in self.index:
                self.index.move_to_end(key)
        self._adopted = (set(promoted), waited_s + self.clock() - started, set(keys))
        return len(promoted)

    def _warm(self, held: list[bytes], keys: list[bytes]) -> None:
        """A warmed template's blocks: those L1 `held` are pinned there, as many as its pin room takes;
        all its `keys` are pinned in L2 when demoted (`_demote`). `held` is head first: the room goes to
        the blocks not pinned yet, so a template extending a pinned one pins its own blocks."""
        new = [key for key in held if key not in self.pinned]
        self.pinned.update(new[: pin_room(self.capacity, self.pinned)])
        for position, key in enumerate(keys):
            self.warmed.setdefault(key, (keys[position - 1] if position else None, position))

    def _from_l2(self, rest: list[bytes]) -> list[bytes]:
        """The leading blocks of `rest` L2 holds, brought into L1. L2's hits are the blocks it served (L1
        may take fewer than it holds), its misses the blocks it did not hold: a block held but not taken
        is neither."""
        slots = self.l2.take_run(rest, count_hits=False)
        self.l2_miss_blocks += len(rest) - len(slots)
        promoted = self._promote_from_l2(rest, slots)
        self.l2.hits += len(promoted)
        return promoted

    def _promote_from_l2(self, keys: list[bytes], slots: list[int]) -> list[bytes]:
        """Bring the L2 blocks in `slots` (of the leading `keys`) into the pool; returns the keys now in L1.
        Pinned slots go to the device as asynchronous DMA, one copy per run of slots that are consecutive
        on both sides (a chain demoted together mostly is one run); a pageable L2 is gathered once."""
        l2 = self.l2
        # The allocation demotes L1 blocks to L2: never into the slots being read here.
        indices = self._allocate(min(len(keys), len(slots)), keep=frozenset(keys[: len(slots)]))
        if not indices:
            return []
        with self._freed_on_failure(indices):
            if self.pool.is_cuda and l2.page_locked:
                copy_rows(self.pool, indices, l2.pool, slots, max_runs=math.inf, non_blocking=True)
                l2.note_device_use(self.pool.device)
            else:
                copy_rows(self.pool, indices, l2.pool, slots[: len(indices)], max_runs=0)
        return self._enter(keys, indices)

    def _promote(self, keys: list[bytes], blocks: list[torch.Tensor]) -> list[bytes]:
        """Bring host blocks (L3's, pageable) into the pool in one copy; returns the keys now in L1."""
        indices = self._allocate(min(len(keys), len(blocks)))
        if not indices:
            return []
        with self._freed_on_failure(indices):
            self.pool[self._rows(indices)] = torch.stack(blocks[: len(indices)]).to(self.pool.device)
        return self._enter(keys, indices)

    @contextmanager
    def _freed_on_failure(self, indices: list[int]) -> Iterator[None]:
        """Rows just allocated go back to the free list if filling them raises: indexed nowhere, they
        would be lost to the cache for the life of the process."""
        try:
            yield
        except BaseException:
            self.free.extend(indices)
            raise

    def _enter(self, keys: list[bytes], indices: list[int]) -> list[bytes]:
        """Index the leading `keys` at the rows `indices` just filled, protected until the lookup ends."""
        promoted = keys[: len(indices)]
        for key, index in zip(promoted, indices):
            old = self.index.get(key)
            if old is not None and old != index:  # already held (unreachable behind a missing head): one row
                self.free.append(old)
            self.index[key] = index
            self._protected.add(key)
        return promoted

    def _rows(self, positions: list[int]) -> slice | torch.Tensor:
        return select(positions, self.pool.device)

    def _allocate(self, count: int, keep: frozenset[bytes] = frozenset()) -> list[int]:
        """Up to `count` free pool indices (ascending: mostly one run, a slice), evicting the oldest
        unpinned, unprotected blocks; the evicted blocks go to L2, never into the L2 slots of `keep`."""
        indices = [self.free.pop() for _ in range(min(count, len(self.free)))]
        evicted = self._evict(count - len(indices))
        self.evictions += len(evicted)
        indices += [index for index, _ in evicted]
        if evicted and self.l2 is not None:  # demote rather than forget, copied before any overwrite
            aging = [key for _, key in evicted]  # eviction order: a chain tail first, as L2 keeps it
            evicted.sort()  # by row: rows and L2 slots then form runs
            try:  # straight out of the pool: no gather
                self._demote(evicted, keep, aging)
            except Exception as exc:  # the blocks are forgotten, as when L2 is full; the rows still serve
                self._tier_failed("l2 demotion", exc)
        return sorted(indices)

    def _demote(self, evicted: list[tuple[int, bytes]], keep: frozenset[bytes], aging: list[bytes]) -> None:
        """Copy evicted (row, key) blocks to L2; a warmed template's are pinned there, up to half of L2
        (as in L1: an L2 full of pinned blocks could take nothing else), head first: a block only behind
        a pinned parent (in L1 or L2). L1 demotes a template's tail before its head, often one store at a
        time: pinned as they came, the room went to tails whose heads L2 later dropped, pinned blocks no
        lookup could reach and nothing would ever evict. A tail demoted before its head is pinned when
        the head is (`_pin_warm_descendants`)."""
        l2 = self.l2
        warm = []
        if self.warmed:
            room = pin_room(l2.pool.shape[0], l2.pinned)
            candidates = [(row, key) for row, key in evicted if key in self.warmed and key not in l2.pinned]
            anchored: set[bytes] = set()
            for row, key in sorted(candidates, key=lambda pair: self.warmed[pair[1]][1]):  # head first
                if len(warm) == room:
                    break
                parent = self.warmed[key][0]
                if parent is None or parent in self.pinned or parent in l2.pinned or parent in anchored:
                    warm.append((row, key))
                    anchored.add(key)
            warm.sort()  # by row: rows and L2 slots then form runs
        if warm:
            warm_keys = {key for _, key in warm}
            evicted = [(row, key) for row, key in evicted if key not in warm_keys]
            l2.put_many([key for _, key in warm], self.pool, keep, pin=True, rows=[row for row, _ in warm])
        if evicted:
            keys, rows = [key for _, key in evicted], [row for row, _ in evicted]
            l2.put_many(keys, self.pool, keep, rows=rows, oldest_first=aging)
        if warm:
            self._pin_warm_descendants()

    def _pin_warm_descendants(self) -> None:
        """Pin, head first within L2's pin room, the warmed blocks L2 holds unpinned behind a pinned parent:
        a template's tail demoted before its head was."""
        l2 = self.l2
        room = pin_room(l2.pool.shape[0], l2.pinned)
        if not room:
            return
        waiting = sorted(
            (self.warmed[key][1], key) for key in l2.index if key in self.warmed and key not in l2.pinned
        )
        for _, key in waiting:
            if not room:
                return
            parent = self.warmed[key][0]
            if parent is None or parent in self.pinned or parent in l2.pinned:
                l2.pin(key)
                room -= 1

    def _evict(self, count: int) -> list[tuple[int, bytes]]:
        """Take up to `count` of the oldest blocks that may be evicted out of the index, as (row, key), in
        one pass (a call and a fresh scan per victim was ~1.7 us of a 15-block store on the CPU). Pinned
        and protected blocks met on the way move to the recent end (they are never evicted here), so
        later scans do not walk past them again; a whole pass of them in a row ends the scan."""
        evicted: list[tuple[int, bytes]] = []
        passed = 0
        while len(evicted) < count and passed < len(self.index):
            key, index = self.index.popitem(last=False)
            if key in self.pinned or key in self._protected:
                self.index[key] = index
                passed += 1
            else:
                evicted.append((index, key))
                passed = 0
        return evicted
