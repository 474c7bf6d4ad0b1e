"""L2: KV blocks evicted from the device pool, kept in host memory (pinned on CUDA hosts, so the copy
back is a fast DMA), reusable across sessions before anything has to come from Redis.

Eviction is an LRU-K + LFU hybrid: the victim is the block whose K-th most recent use lies furthest
back (blocks used fewer than K times go first, since one-off prompts should not push out prefixes
that keep coming back), ties broken by lower use count, then by older last use. Pinned blocks
(warmed prefixes) are never evicted.

Blocks used fewer than K times (at 0% hits, every demoted block: one use each) are kept in
insertion-ordered tables per use count, oldest first, which is their eviction order; only blocks with K
uses go on the heap. A demotion then costs dict operations, not heap pushes and pops of stale entries.
Such a block, unless pinned, keeps no other state: its table entry holds the ticks of its uses, and its
history and rank (which holds its use count) are built at its K-th use (or when it is pinned). At 0%
hits every demotion is a new key evicting the oldest once-used block, which `put_many` does in a few dict
operations: with the full bookkeeping per key, a store's 15 demotions cost ~20 us of host time on the
CPU VM, now ~6.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence

import torch

from engine.block_rows import copy_rows
from engine.pinned_memory import page_locked_empty


class HostBlockPool:
    def __init__(
        self, capacity: int, block_shape: tuple[int, ...], dtype: torch.dtype, pin: bool, k: int = 2
    ):
        shape = (capacity, *block_shape)
        self.pool, self._page_locked = (
            page_locked_empty(shape, dtype) if pin else (torch.empty(shape, dtype=dtype), False)
        )  # page-locked: device copies out of and into the slots are asynchronous DMA
        self.k = k
        self.index: dict[bytes, int] = {}
        self.history: dict[bytes, deque[int]] = {}
        self.pinned: set[bytes] = set()
        self.ranks: dict[bytes, tuple[int, int, int]] = {}  # K uses or pinned; else see `rank`
        self._heap: list[tuple[int, int, int, bytes]] = []  # lazy: entries whose rank changed are skipped
        self.free = list(range(capacity - 1, -1, -1))
        self._tick = itertools.count()
        # uses -> keys with that many uses (< k) -> the ticks of their uses, oldest last use first;
        # pinned keys are left out (they have a history), and table 0 stays empty
        self._young: list[OrderedDict[bytes, tuple[int, ...]]] = [OrderedDict() for _ in range(k)]
        self.evictions = 0
        self.hits = 0
        self._event: torch.cuda.Event | None = None
        self._stream: torch.cuda.Stream | None = None
        self._inflight = False

    def __contains__(self, key: bytes) -> bool:
        return key in self.index

    def put(
        self,
        key: bytes,
        block: torch.Tensor,
        pin: bool = False,
        keep: frozenset[bytes] = frozenset(),
    ) -> bool:
        """Keep a copy of `block`; False when every slot holds a pinned (or kept) block.
        `keep`: keys that must not be evicted to make room (blocks the caller is still reading)."""
        return self.put_many([key], block.unsqueeze(0), keep, pin) == 1

    def put_many(
        self,
        keys: list[bytes],
        blocks: torch.Tensor,
        keep: frozenset[bytes] = frozenset(),
        pin: bool = False,
        rows: list[int] | None = None,
        oldest_first: Sequence[bytes] = (),
    ) -> int:
        """`put` for a run of blocks [n, ...] on any device; returns how many were kept. `rows`: the row of
        `blocks` that holds each key's block (default: the key's position), so that blocks demoted from a
        pool are copied out of it directly, with no gather into a temporary first. `oldest_first`: the new
        once-used keys in the order they should age here when it is not `keys`' (given in row order, so
        that rows and slots stay runs, one copy each): a chain demoted from L1 ages tail first, as there,
        so that L2 never drops a head and keeps a tail no lookup can reach.

        From CUDA, each run of consecutive slots is one asynchronous copy straight into pinned memory,
        and nothing waits for it: the device's stream orders it before any later copy out of or into
        those slots, and host access waits for it (`settle`). Syncing here stalled the engine thread
        on every store once the device pool was full (each store then demotes). Copying the run to
        pageable host memory first and then into the slots cost ~10x more on the H200. From host
        memory, a copy per run when there are few, else one gather and one scatter."""
        stored, row_of_slot = 0, {}  # a run longer than the pool reuses slots: the later block wins
        new_path = not pin and self.k > 1
        entered: dict[bytes, int] = {}  # new keys and the slot each was given last
        order: Iterable[int] = range(len(keys))
        if oldest_first:  # slots handed out tail first: with little room the head evicts the tail, not back
            age = {key: i for i, key in enumerate(oldest_first)}
            order = sorted(order, key=lambda position: age.get(keys[position], len(age)))
        for position in order:
            key = keys[position]
            if new_path and key not in self.index:
                index = self._slot_for_new(key, keep)
                if index is not None:
                    entered[key] = index
            else:
                index = self._slot_for(key, pin, keep)
            if index is not None:
                stored += 1
                row_of_slot[index] = position if rows is None else rows[position]
        if not row_of_slot:
            return 0
        # The run was entered in its aging order (`order`): each key's use, new or held, is already
        # ticked in that order. (New keys used to be ticked again here, after the run: a new tail then
        # aged after the head L2 already held, and once both had K uses L2 evicted the head first.)
        self._in_row_order(entered, row_of_slot)
        slots, sources = list(row_of_slot), list(row_of_slot.values())
        try:
            if blocks.is_cuda:
                copy_rows(self.pool, slots, blocks, sources, max_runs=math.inf, non_blocking=True)
                self.note_device_use(blocks.device)
            else:
                self.settle()
                copy_rows(self.pool, slots, blocks, sources)
        except BaseException:
            # the slots may still hold the blocks they held before (another tenant's): no key may name them
            written = set(slots)
            for key in dict.fromkeys(keys):
                if self.index.get(key) in written:
                    self.free.append(self._drop(key))
            raise
        return stored

    def _in_row_order(self, entered: dict[bytes, int], row_of_slot: dict[int, int]) -> None:
        """Give the new keys of one `put_many` their slots in ascending order of their source rows.

        The slots a demotion frees are those of an earlier demotion's blocks, handed out in their aging
        order (a chain's tail first): in source-row order they descended, so no two rows and slots made a
        run and a 15-block demotion from CUDA was 15 copies (~0.14 ms of a 0.2 ms store on the H200 host).
        Any new key may take any of these slots, so sorting both sides makes the usual demotion of one
        evicted chain one copy, and its later promotion (`take_run`) one copy too. A key whose slot a
        later key of the same run took is no longer held and keeps none."""
        held = [(row_of_slot[s], key, s) for key, s in entered.items() if self.index.get(key) == s]
        if len(held) < 2:
            return
        held.sort()
        for (row, key, _), slot in zip(held, sorted(slot for _, _, slot in held)):
            self.index[key] = slot
            row_of_slot[slot] = row

    def note_device_use(self, device: torch.device) -> None:
        """Asynchronous device copies into or out of the slots were queued: host access waits for them.

        One event, re-recorded, on the stream the engine thread stores from (looked up once): a new
        event and the stream lookup cost ~130 us a store on the H200 host."""
        if not self._page_locked:
            return
        if self._event is None:
            self._event, self._stream = torch.cuda.Event(), torch.cuda.current_stream(device)
        self._event.record(self._stream)
        self._inflight = True

    def settle(self) -> None:
        """Wait for the queued device copies of the slots (usually long done: an event query)."""
        if self._inflight and self._event is not None:
            self._event.synchronize()
            self._inflight = False

    def pin(self, key: bytes) -> bool:
        """Pin a block held here (never evicted from now on), without rewriting it; False if not held."""
        if key not in self.index:
            return False
        if key not in self.pinned:
            self.pinned.add(key)
            self._touch(key)  # a pinned block keeps a history, never a young table's entry
        return True

    def _slot_for(self, key: bytes, pin: bool, keep: frozenset[bytes]) -> int | None:
        """The slot `key` is (re)written to, counted as a use; None when every slot is pinned or kept."""
        if key not in self.index:
            index = self.free.pop() if self.free else self._evict(keep)
            if index is None:
                return None
            self.index[key] = index
        if pin:
            self.pinned.add(key)
        self._touch(key)
        return self.index[key]

    def _slot_for_new(self, key: bytes, keep: frozenset[bytes]) -> int | None:
        """`_slot_for` of a key not held here, unpinned, with K > 1 (every demotion at 0% hits; with K = 1
        one use puts a block on the heap): the oldest once-used block, when it is the victim, is evicted
        and `key` enters its table in a few dict operations, with no call to `victim` or `_touch`."""
        young = self._young[1]
        if self.free:
            index = self.free.pop()
        elif young and (oldest := next(iter(young))) not in keep:  # once-used blocks go first
            del young[oldest]
            index = self.index.pop(oldest)
            self.evictions += 1
        elif (index := self._evict(keep)) is None:
            return None
        self.index[key] = index
        young[key] = (next(self._tick),)
        return index

    def get(self, key: bytes) -> torch.Tensor | None:
        slots = self.take_run([key])
        return self.pool[slots[0]] if slots else None

    def take_run(self, keys: list[bytes], count_hits: bool = True) -> list[int]:
        """The slots of the leading keys held here, each counted as a use, the last key's first: the head
        ends the most recent, as in L1. The caller copies the run out of `pool` itself (on CUDA, one copy
        per run of consecutive slots): a tensor view per block and a copy per block cost ~30 us a block on
        the H200 host, ~3.5 ms for a 2048-token prefix. `count_hits` False: the caller counts the blocks
        it served (`hits`), which may be fewer than it was given."""
        slots = []
        for key in keys:
            index = self.index.get(key)
            if index is None:
                break
            slots.append(index)
        for key in reversed(keys[: len(slots)]):  # the head used last: a chain ages tail first
            self._touch(key)
        if slots:
            if count_hits:
                self.hits += len(slots)
            self.settle()
        return slots

    @property
    def bytes(self) -> int:
        return self.pool.numel() * self.pool.element_size()

    @property
    def page_locked(self) -> bool:
        """Whether the slots are pinned memory: device copies out of them are asynchronous DMA."""
        return self._page_locked

    def victim(self, keep: frozenset[bytes] = frozenset()) -> bytes | None:
        """The key eviction would take now (never one in `keep`), in O(log n) amortized (a scan per
        eviction made every promotion of a long chain quadratic: 100+ ms per request with a full pool)."""
        for young in self._young[1:]:  # fewer than K uses: fewer uses first, then the oldest
            for key in young:
                if key not in keep:
                    return key
        kept = []
        try:
            while self._heap:
                *rank, key = self._heap[0]
                if self.ranks.get(key) != tuple(rank) or key in self.pinned:
                    heapq.heappop(self._heap)  # stale, evicted or pinned (pinned blocks are never evicted)
                elif key in keep:
                    kept.append(heapq.heappop(self._heap))  # back on the heap below
                else:
                    return key
            return None
        finally:
            for entry in kept:
                heapq.heappush(self._heap, entry)

    def rank(self, key: bytes) -> tuple[int, int, int]:
        """`key`'s eviction rank, lowest evicted first: (K-th most recent use, or -1 with fewer than K
        uses, uses, last use). Kept in `ranks` from the K-th use or pinning on; computed before."""
        if (rank := self.ranks.get(key)) is not None:
            return rank
        ticks = next(young[key] for young in self._young if key in young)
        return (-1, len(ticks), ticks[-1])

    def _touch(self, key: bytes) -> None:
        tick = next(self._tick)
        history = self.history.get(key)
        if history is None:  # fewer than K uses and unpinned until now (or new): state in a young table
            ticks = self._leave_young(key) + (tick,)
            if len(ticks) < self.k and key not in self.pinned:
                self._young[len(ticks)][key] = ticks
                return
            history = self.history[key] = deque(ticks, maxlen=self.k)
            uses = len(ticks)
        else:
            history.append(tick)
            uses = self.ranks[key][1] + 1  # a block with a history has a rank
        kth = history[0] if len(history) == self.k else -1  # fewer than K uses: infinitely old
        rank = (kth, uses, tick)
        self.ranks[key] = rank
        if uses < self.k:  # pinned: never evicted, never on the heap
            return
        heapq.heappush(self._heap, (*rank, key))
        if len(self._heap) > 4 * len(self.ranks) + 64:  # stale entries only leave from the top: rebuild
            self._heap = [(*rank, key) for key, rank in self.ranks.items()]
            heapq.heapify(self._heap)

    def _leave_young(self, key: bytes) -> tuple[int, ...]:
        """Take `key` out of the table of its use count; the ticks of its uses, () if it is in none."""
        for young in self._young[1:]:
            if (ticks := young.pop(key, None)) is not None:
                return ticks
        return ()

    def _evict(self, keep: frozenset[bytes]) -> int | None:
        key = self.victim(keep)
        if key is None:
            return None
        self.evictions += 1
        return self._drop(key)

    def _drop(self, key: bytes) -> int:
        """Forget `key` everywhere; returns its slot (the caller reuses or frees it)."""
        if key in self.history:
            del self.history[key], self.ranks[key]
        else:
            self._leave_young(key)
        self.pinned.discard(key)
        return self.index.pop(key)
