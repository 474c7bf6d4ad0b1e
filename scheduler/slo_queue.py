"""SLO-aware admission queue: tier precedence with aging, EDF within a tier, per-tenant fair share.

`SloQueue` keeps the interface of the plain precedence heap it replaced (same methods, same
semantics for a single tenant while nobody has waited long enough to age), so the engine can swap it in.
It adds what a shared LLM replica needs under overload:

* **Strict precedence between tiers, with aging.** A lower tier must not starve behind a steady stream of
  higher-tier work, so a request's effective level improves by one per `aging_ns / weight(tier)` waited,
  down to `aging_floor`. When the winning tier won *because of* aging, or tied with another tier on
  level, its oldest request is served (FIFO), which is what makes the wait bound of `max_wait_bound_ns`
  hold: once a request reaches the floor level no later arrival at that level can overtake it.
  The default floor is the level just below the top tier: aged requests never overtake the top
  (SLO-critical) tier, because under sustained overload aging into the top level feeds the lower tiers'
  whole arrival rate in front of critical requests (measured with scheduler/simulation.py: critical
  attainment fell from 0.64 to 0.14 at 1.4x load). Pass `aging_floor=` the top priority to trade that
  protection for a bound that does not depend on the top tier's load.
* **Earliest deadline first** inside a tier (and inside a tenant), arrival order on ties.
* **Per-tenant fair share inside a tier**, in the spirit of VTC (Sheng et al., "Fairness in Serving Large
  Language Models", OSDI 2024): every (tier, tenant) has a virtual counter; the tenant with the smallest
  counter among those with queued requests is served, and its counter advances by cost / weight. A tenant
  that becomes active again is lifted to the smallest active counter so idle time cannot be banked.
* **Bounded capacity**: pushes beyond `max_len` (or a per-tier limit) raise `QueueFull` (UNAVAILABLE),
  never a silent drop.

Everything reads time from the injected `clock`, so tests and the simulator drive it deterministically.
Not thread-safe: the engine guards it with its own lock.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from scheduler.errors import RequestError
from scheduler.tiers import TierTable

T = TypeVar("T")
DEFAULT_TENANT = "default"
# Idle tenants whose counters are kept (they served more than a comeback's lift): each costs a dict entry
# and an LRU entry (~250 bytes). Past it the longest idle one's counter goes, and its next request is lifted
# as a newcomer's: one-off tenants (a tenant per end user) grew the table for the process's life.
IDLE_COUNTERS = 4096


class QueueFull(RequestError):
    """A push beyond the queue's capacity (UNAVAILABLE); `tier` names the tier whose request was refused."""

    def __init__(self, tier: str, priority: int, queued: int, limit: int, scope: str) -> None:
        super().__init__(
            "UNAVAILABLE",
            f"queue full: tier {tier!r} cannot queue another request ({queued}/{limit} queued {scope}); "
            "retry later or on another replica",
        )
        self.tier = tier
        self.priority = priority
        self.queued = queued
        self.limit = limit


@dataclass(frozen=True, order=True)
class SloEntry(Generic[T]):
    """One queued item. Sorting follows the static order (priority, deadline_ns, seq) (the heap order)."""

    priority: int
    deadline_ns: int
    seq: int
    key: Hashable = field(compare=False)
    item: T = field(compare=False)
    expires_ns: int | None = field(default=None, compare=False)
    tenant: str = field(default=DEFAULT_TENANT, compare=False)
    cost: float = field(default=1.0, compare=False)
    enqueued_ns: int = field(default=0, compare=False)


@dataclass
class _Bucket(Generic[T]):
    """All queued entries of one priority level; heaps use lazy deletion (checked against `_live`)."""

    priority: int
    by_tenant: dict[str, list[tuple[int, int, SloEntry[T]]]] = field(default_factory=dict)
    by_age: list[tuple[int, int, SloEntry[T]]] = field(default_factory=list)
    tenant_live: dict[str, int] = field(default_factory=dict)
    live: int = 0
    lanes: list[tuple[float, int, int, str]] = field(default_factory=list)  # (counter, head deadline, seq)
    mark: float = 0.0  # counter of the last tenant served here, before its charge (VTC lift when idle)


def default_aging_floor(tiers: TierTable) -> int:
    """One level below the top tier (aging never overtakes SLO-critical work); the only level if one."""
    levels = sorted({t.priority for t in tiers})
    return levels[1] if len(levels) > 1 else levels[0]


def default_aging_ns(tiers: TierTable, floor: int | None = None) -> int:
    """An aging step such that every tier reaches the floor level within half its `max_queue_ms`.

    Why half: a request should get its turn well before the engine would expire it for having queued too
    long, and the other half leaves room for the requests that were already at the floor level.
    """
    floor = default_aging_floor(tiers) if floor is None else floor
    steps = [t.max_queue_ns // (2 * (t.priority - floor)) for t in tiers if t.priority > floor]
    return max(1, min(steps)) if steps else 1_000_000_000


def tenant_weight(
    rate_per_s: float,
    p99_ms: float,
    error_rate: float,
    *,
    target_ms: float,
    base: float = 1.0,
    latency_gain: float = 0.5,
    error_penalty: float = 1.0,
    min_rate_per_s: float = 0.1,
    min_weight: float = 0.25,
    max_weight: float = 4.0,
) -> float:
    """A tenant's fair-share weight from the load figures the engine records for it.

    * Latency: a tenant whose P99 first-token latency is above `target_ms` gets a larger share,
      `(p99 / target) ** latency_gain` (a square root by default, so one bad window does not swing it).
    * Errors: requests that fail burn service without producing anything useful (retry storms, bad
      inputs), so the share shrinks with `(1 - error_rate) ** error_penalty`.
    * Rate is the evidence gate, not a reward: a busier tenant must not get a larger share (that is what
      fair share protects against), but below `min_rate_per_s` its P99 comes from too few samples to act
      on, so the latency factor is neutral.

    The result is clamped to [min_weight, max_weight]; feed it to `SloQueue.set_tenant_weight`.
    """
    if target_ms <= 0:
        raise ValueError(f"target_ms must be > 0, got {target_ms!r}")
    if not 0.0 <= error_rate <= 1.0:
        raise ValueError(f"error_rate must be in [0, 1], got {error_rate!r}")
    latency = 1.0
    if rate_per_s >= min_rate_per_s and p99_ms > 0 and math.isfinite(p99_ms):
        latency = (p99_ms / target_ms) ** latency_gain
    errors = (1.0 - error_rate) ** error_penalty
    return min(max_weight, max(min_weight, base * latency * errors))


def _check_weight(what: str, weight: float) -> float:
    weight = float(weight)
    if not (weight > 0 and math.isfinite(weight)):
        raise ValueError(f"{what} weight must be a finite number > 0, got {weight!r}")
    return weight


class SloQueue(Generic[T]):
    """Tier precedence with aging, EDF within a tier, VTC fair share per tenant; see the module docstring.

    `aging_ns`: None derives it from the tiers (`default_aging_ns`); 0 disables aging (strict precedence).
    `aging_floor`: the best level aging can reach (default: one below the top tier's priority, so aging
    never overtakes the top tier; with a single tier, that tier's priority).
    `fair_share`: False serves a tier by EDF across all tenants (a baseline for the simulator).
    `tier_max_len`: optional per-tier limits (by name or priority), on top of the global `max_len`.
    `idle_counters` (default IDLE_COUNTERS): how many idle tenants' counters are kept at most.
    """

    def __init__(
        self,
        tiers: TierTable | None = None,
        *,
        aging_ns: int | None = None,
        aging_floor: int | None = None,
        max_len: int | None = None,
        tier_max_len: Mapping[str | int, int] | None = None,
        fair_share: bool = True,
        clock: Callable[[], int] = time.monotonic_ns,
        idle_counters: int | None = None,
    ) -> None:
        self.tiers = tiers if tiers is not None else TierTable.defaults()
        self._names = {}
        for tier in self.tiers:
            self._names.setdefault(tier.priority, tier.name)
        self._floor = default_aging_floor(self.tiers) if aging_floor is None else int(aging_floor)
        self._aging_ns = default_aging_ns(self.tiers, self._floor) if aging_ns is None else int(aging_ns)
        if self._aging_ns < 0:
            raise ValueError(f"aging_ns must be >= 0 (0 disables aging), got {aging_ns!r}")
        if max_len is not None and max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {max_len!r}")
        self._max_len = max_len
        self._tier_max_len = {self._priority(k): int(v) for k, v in (tier_max_len or {}).items()}
        self._fair_share = fair_share
        self._clock = clock
        self._buckets: dict[int, _Bucket[T]] = {}
        self._live: dict[Hashable, SloEntry[T]] = {}
        self._counters: dict[tuple[int, str], float] = {}
        # (priority, lane) of the idle tenants whose counter is kept, the longest idle first (bounded)
        self._idle: OrderedDict[tuple[int, str], None] = OrderedDict()
        self._idle_limit = max(0, int(IDLE_COUNTERS if idle_counters is None else idle_counters))
        self._tenant_weights: dict[str, float] = {}
        self._tier_weights: dict[int, float] = {}
        self._next_seq = 0

    # ----- configuration -------------------------------------------------------------------------------

    @property
    def aging_ns(self) -> int:
        return self._aging_ns

    @property
    def aging_floor(self) -> int:
        return self._floor

    @property
    def max_len(self) -> int | None:
        return self._max_len

    def set_tenant_weight(self, tenant: str, weight: float) -> None:
        """A tenant's share inside each tier: its counter advances by cost / weight (see `tenant_weight`)."""
        self._tenant_weights[tenant] = _check_weight(f"tenant {tenant!r}", weight)

    def tenant_weight(self, tenant: str) -> float:
        return self._tenant_weights.get(tenant, 1.0)

    def set_tier_weight(self, tier: str | int, weight: float) -> None:
        """A tier's aging rate multiplier (from the feedback controller): weight 2 ages twice as fast.

        Weights change how soon a tier's waiting requests climb levels, never the order of tiers that
        nobody has waited for, so a fresh critical request still goes first.
        """
        self._tier_weights[self._priority(tier)] = _check_weight(f"tier {tier!r}", weight)

    def tier_weight(self, tier: str | int) -> float:
        return self._tier_weights.get(self._priority(tier), 1.0)

    def tier_aging_ns(self, tier: str | int) -> int | None:
        """Wait that buys one level for this tier with its current weight; None when aging is off."""
        if self._aging_ns == 0:
            return None
        return max(1, round(self._aging_ns / self._tier_weights.get(self._priority(tier), 1.0)))

    def max_wait_bound_ns(self, tier: str | int, service_ns: int = 0) -> int | None:
        """Bound on how long a request of `tier` waits, with the current tier weights.

        After `(priority - aging_floor) * tier_aging_ns(tier)` the request is at the floor level, and from
        then on only requests that were queued before it can be served ahead of it, provided its own tier
        serves it before its later arrivals (one tenant, deadlines in arrival order: EDF is then FIFO).
        There are at most `max_len - 1` of those, so with `service_ns` = the longest interval between two
        pops that go to requests at or below the floor level (tiers above the floor always go first; with
        the floor at the top tier that is any two pops while the queue is non-empty), the bound is that
        promotion delay + `max_len * service_ns`.
        Returns the promotion delay alone when service_ns is 0, and None when no bound exists (aging off
        for a tier below the floor, or service_ns given without a max_len).
        """
        priority = self._priority(tier)
        if priority <= self._floor:
            promotion = 0
        else:
            aging = self.tier_aging_ns(priority)
            if aging is None:
                return None
            promotion = (priority - self._floor) * aging
        if service_ns <= 0:
            return promotion
        if self._max_len is None:
            return None
        return promotion + self._max_len * int(service_ns)

    # ----- AdmissionQueue interface ----------------------------------------------------------------------

    def push(
        self,
        item: T,
        priority: int,
        deadline_ns: int,
        *,
        key: Hashable | None = None,
        expires_ns: int | None = None,
        tenant: str = DEFAULT_TENANT,
        cost: float = 1.0,
        now_ns: int | None = None,
        check_capacity: bool = True,
        tier: str | None = None,
    ) -> Hashable:
        """Queue `item`; returns its key (the given one, else a fresh sequence number) for `remove`.

        `cost` is what serving it charges the tenant's counter (e.g. prompt + expected output tokens);
        `now_ns` is its arrival time for aging (default: the clock). Raises QueueFull at capacity,
        unless `check_capacity` is False (work taken back from a slot must not be dropped); `tier` is the
        name a refusal gives (default: the tier of `priority`, which a policy may have flattened).
        """
        priority = int(priority)
        cost = float(cost)
        if not (cost > 0 and math.isfinite(cost)):
            raise ValueError(f"cost must be a finite number > 0, got {cost!r}")
        if key is not None and key in self._live:
            raise ValueError(f"key {key!r} is already queued; keys must be unique among queued items")
        if check_capacity:
            self._check_capacity(priority, tier)
        now = self._clock() if now_ns is None else int(now_ns)
        seq = self._next_seq
        self._next_seq += 1
        if key is None:  # the sequence number, unless a caller gave it as a key of its own
            while seq in self._live:
                seq = self._next_seq
                self._next_seq += 1
            key = seq
        if key in self._live:
            raise ValueError(f"key {key!r} is already queued; keys must be unique among queued items")
        entry = SloEntry(priority, int(deadline_ns), seq, key, item, expires_ns, tenant, cost, now)
        bucket = self._buckets.get(priority)
        if bucket is None:
            bucket = self._buckets[priority] = _Bucket(priority)
        lane = self._lane(tenant)
        if bucket.tenant_live.get(lane, 0) == 0:
            self._activate(bucket, lane)
        self._live[key] = entry
        bucket.live += 1
        bucket.tenant_live[lane] = bucket.tenant_live.get(lane, 0) + 1
        tenant_heap = bucket.by_tenant.setdefault(lane, [])
        heapq.heappush(tenant_heap, (entry.deadline_ns, seq, entry))
        heapq.heappush(bucket.by_age, (now, seq, entry))
        if tenant_heap[0][2] is entry:
            self._refresh_lane(bucket, lane)
        return key

    def pop(self, now_ns: int | None = None) -> T:
        """The item with the highest effective precedence now; IndexError when empty."""
        return self.pop_entry(now_ns).item

    def pop_entry(self, now_ns: int | None = None) -> SloEntry[T]:
        entry = self.peek_entry(now_ns)
        self._serve(entry)
        return entry

    def take(self, key: Hashable) -> T | None:
        """Serve a queued item out of turn (e.g. a backfill into a slot the head cannot use): removed as
        `remove` does, but charged to its tenant's fair-share counter as `pop` charges; None if not queued."""
        entry = self._live.get(key)
        if entry is None:
            return None
        self._serve(entry)
        return entry.item

    def _serve(self, entry: SloEntry[T]) -> None:
        """Charge `entry`'s tenant for it (VTC) and take it off the queue."""
        bucket = self._buckets[entry.priority]
        lane = self._lane(entry.tenant)
        counter = self._counters.get((entry.priority, lane), bucket.mark)
        bucket.mark = counter
        self._counters[(entry.priority, lane)] = counter + entry.cost / self.tenant_weight(entry.tenant)
        self._discard(entry)
        self._refresh_lane(bucket, lane)

    def peek(self, now_ns: int | None = None) -> T:
        """The item `pop` would return at the same time, without removing it; IndexError when empty."""
        return self.peek_entry(now_ns).item

    def peek_entry(self, now_ns: int | None = None) -> SloEntry[T]:
        if not self._live:
            raise IndexError("peek from an empty SloQueue")
        now = self._clock() if now_ns is None else int(now_ns)
        return self._select(now)

    def remove(self, key: Hashable) -> T | None:
        """Cancel a queued item; returns it, or None if it is not queued (already popped or unknown)."""
        entry = self._live.get(key)
        if entry is None:
            return None
        self._discard(entry)
        return entry.item

    def pop_expired(self, now_ns: int) -> list[SloEntry[T]]:
        """Remove and return entries whose `expires_ns` has passed (queued too long to be worth running)."""
        expired = [e for e in self._live.values() if e.expires_ns is not None and e.expires_ns <= now_ns]
        for entry in expired:
            self._discard(entry)
        return sorted(expired)

    def earliest_expiry_ns(self) -> int | None:
        """The soonest `expires_ns` among queued entries (None: none expires); linear, for a caller that
        asks only when an expiry it knew of has come."""
        return min((e.expires_ns for e in self._live.values() if e.expires_ns is not None), default=None)

    def entries(self) -> Iterator[SloEntry[T]]:
        """Queued entries in static order (priority, deadline, seq); aging and fair share are not applied."""
        return iter(sorted(self._live.values()))

    def __len__(self) -> int:
        return len(self._live)

    def __bool__(self) -> bool:
        return bool(self._live)

    def __contains__(self, key: object) -> bool:
        return key in self._live

    # ----- observation -----------------------------------------------------------------------------------

    def oldest_wait_ns(self, now_ns: int | None = None) -> dict[str, int]:
        """How long the oldest queued request of each tier has waited (0 for an empty tier), by tier name."""
        now = self._clock() if now_ns is None else int(now_ns)
        waits = {name: 0 for name in self._names.values()}
        for priority, bucket in self._buckets.items():
            if bucket.live:
                waits[self._name(priority)] = max(0, now - self._oldest(bucket).enqueued_ns)
        return waits

    def queued_by_tier(self) -> dict[str, int]:
        counts = {name: 0 for name in self._names.values()}
        for priority, bucket in self._buckets.items():
            if bucket.live:
                counts[self._name(priority)] = counts.get(self._name(priority), 0) + bucket.live
        return counts

    def counter(self, tier: str | int, tenant: str) -> float:
        """A tenant's virtual counter in a tier (for tests and metrics)."""
        priority = self._priority(tier)
        bucket = self._buckets.get(priority)
        return self._counters.get((priority, self._lane(tenant)), bucket.mark if bucket else 0.0)

    # ----- internals -------------------------------------------------------------------------------------

    def _priority(self, tier: str | int) -> int:
        if isinstance(tier, int) and not isinstance(tier, bool):
            return tier
        return self.tiers.get(str(tier)).priority

    def _name(self, priority: int) -> str:
        return self._names.get(priority, f"priority-{priority}")

    def _lane(self, tenant: str) -> str:
        return tenant if self._fair_share else DEFAULT_TENANT

    def _check_capacity(self, priority: int, tier: str | None = None) -> None:
        name = self._name(priority) if tier is None else tier
        if self._max_len is not None and len(self._live) >= self._max_len:
            raise QueueFull(name, priority, len(self._live), self._max_len, "in all tiers")
        limit = self._tier_max_len.get(priority)
        bucket = self._buckets.get(priority)
        queued = bucket.live if bucket else 0
        if limit is not None and queued >= limit:
            raise QueueFull(name, priority, queued, limit, "in this tier")

    def _level(self, priority: int, waited_ns: int) -> int:
        if priority <= self._floor or self._aging_ns == 0:
            return priority
        aging = max(1, round(self._aging_ns / self._tier_weights.get(priority, 1.0)))
        return max(self._floor, priority - max(0, waited_ns) // aging)

    def _select(self, now: int) -> SloEntry[T]:
        candidates = []
        for bucket in self._buckets.values():
            if bucket.live:
                head = self._oldest(bucket)
                level = self._level(bucket.priority, now - head.enqueued_ns)
                candidates.append((level, head.enqueued_ns, head.seq, bucket.priority))
        level, _, _, priority = min(candidates)
        bucket = self._buckets[priority]
        native = min(c[3] for c in candidates)
        contested = sum(1 for c in candidates if c[0] == level) > 1
        if priority != native or contested:
            return self._oldest(bucket)  # won by aging or on age at a tied level: serve the one that waited
        return self._fair_pick(bucket)

    def _fair_pick(self, bucket: _Bucket[T]) -> SloEntry[T]:
        """The head of the active tenant with the smallest counter (earliest head deadline on ties).

        `bucket.lanes` is a heap of (counter, head deadline, head seq, tenant) snapshots, pushed whenever a
        tenant's counter or head changes; a snapshot that no longer matches is stale and skipped, so a pick
        costs O(log tenants) amortized instead of a scan over all tenants.
        """
        lanes = bucket.lanes
        while lanes:
            counter, deadline, seq, lane = lanes[0]
            if bucket.tenant_live.get(lane, 0) > 0 and counter == self._counters[(bucket.priority, lane)]:
                head = self._clean_top(bucket.by_tenant[lane])
                if head.seq == seq and head.deadline_ns == deadline:
                    return head
            heapq.heappop(lanes)
        raise AssertionError("a non-empty tier has no active tenant")  # an invariant, not an input error

    def _refresh_lane(self, bucket: _Bucket[T], lane: str) -> None:
        """Push a fresh snapshot of an active tenant's (counter, head); compact when stale ones pile up."""
        if bucket.tenant_live.get(lane, 0) <= 0:
            return
        head = self._clean_top(bucket.by_tenant[lane])
        counter = self._counters[(bucket.priority, lane)]
        heapq.heappush(bucket.lanes, (counter, head.deadline_ns, head.seq, lane))
        if len(bucket.lanes) > 2 * len(bucket.tenant_live) + 16:
            fresh = []
            for name in bucket.tenant_live:
                top = self._clean_top(bucket.by_tenant[name])
                fresh.append((self._counters[(bucket.priority, name)], top.deadline_ns, top.seq, name))
            heapq.heapify(fresh)
            bucket.lanes = fresh

    def _oldest(self, bucket: _Bucket[T]) -> SloEntry[T]:
        return self._clean_top(bucket.by_age)

    def _clean_top(self, heap: list[tuple[int, int, SloEntry[T]]]) -> SloEntry[T]:
        while self._live.get(heap[0][2].key) is not heap[0][2]:
            heapq.heappop(heap)
        return heap[0][2]

    def _activate(self, bucket: _Bucket[T], lane: str) -> None:
        """A tenant with nothing queued in this tier gets work: lift its counter so it cannot bank credit."""
        active = [self._counters.get((bucket.priority, t), bucket.mark) for t in bucket.tenant_live]
        lift = min(active) if active else bucket.mark
        key = (bucket.priority, lane)
        self._idle.pop(key, None)
        self._counters[key] = max(self._counters.get(key, lift), lift)

    def _discard(self, entry: SloEntry[T]) -> None:
        """Forget a queued entry; heaps drop it lazily and are compacted (by filtering) past 2x garbage."""
        del self._live[entry.key]
        bucket = self._buckets[entry.priority]
        lane = self._lane(entry.tenant)
        bucket.live -= 1
        bucket.tenant_live[lane] -= 1
        if bucket.tenant_live[lane] == 0:
            del bucket.tenant_live[lane]
            del bucket.by_tenant[lane]
            self._forget_if_behind(bucket, lane)
        else:
            tenant_heap = bucket.by_tenant[lane]
            was_head = tenant_heap[0][2] is entry
            if len(tenant_heap) > 2 * bucket.tenant_live[lane] + 16:
                tenant_heap = bucket.by_tenant[lane] = self._compacted(tenant_heap)
            if was_head:
                self._refresh_lane(bucket, lane)
        if bucket.live == 0:
            bucket.by_age.clear()
            bucket.lanes.clear()
        elif len(bucket.by_age) > 2 * bucket.live + 16:
            bucket.by_age = self._compacted(bucket.by_age)

    def _compacted(self, heap: list[tuple[int, int, SloEntry[T]]]) -> list[tuple[int, int, SloEntry[T]]]:
        kept = [row for row in heap if self._live.get(row[2].key) is row[2]]
        heapq.heapify(kept)
        return kept

    def _forget_if_behind(self, bucket: _Bucket[T], lane: str) -> None:
        """Drop an idle tenant's counter when a comeback would lift it anyway (keeps memory bounded)."""
        key = (bucket.priority, lane)
        active = [self._counters.get((bucket.priority, t), bucket.mark) for t in bucket.tenant_live]
        if self._counters.get(key, bucket.mark) <= (min(active) if active else bucket.mark):
            self._counters.pop(key, None)
            return
        self._idle[key] = None  # ahead of the lift: kept, within a bound (IDLE_COUNTERS)
        while len(self._idle) > self._idle_limit:
            self._counters.pop(self._idle.popitem(last=False)[0], None)
