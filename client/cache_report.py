"""`python -m client cache`: the cache tiers at a glance, from Triton's /metrics.

The engine exports one counter family per tier (`llm_engine_cache_total{tier, counter}`) and one gauge
family (`llm_engine_cache_state{tier, gauge}`); an operator asking "is the cache doing anything, is it
full, is Redis healthy?" should not have to write PromQL for it. Counters are cumulative since the
engine started; a hit is a block for the KV tiers (L1/L2/L3) and a request for the response caches.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from client.metrics import metric_total
from engine.cache_sizing import human

TIERS = ("l1", "l2", "l3", "exact", "semantic")
UNITS = {"l1": "blocks", "l2": "blocks", "l3": "chains", "exact": "requests", "semantic": "requests"}
# L3 over the chains it was asked for: served (all or part) or not (Redis lacked it, or recomputing won)
L3_SERVED, L3_NOT_SERVED = ("chains_loaded", "chains_partial"), ("chains_missing", "chains_recompute")
HIT_COUNTER = {"l1": "hit_blocks", "l2": "hit_blocks"}  # others: "hits"
MISS_COUNTER = {"l1": "miss_blocks", "l2": "miss_blocks"}  # blocks asked that the tier did not hold
BAD_COUNTERS = ("corrupt", "checksum_failures", "incompatible", "incomplete", "bad_indexes")
DECISIONS = ("load", "recompute", "explore")  # the L3 cost model's, per chain Redis held


@dataclass(frozen=True)
class TierRow:
    tier: str
    unit: str
    hits: float
    misses: float | None  # L1/L2: blocks a lookup asked for past the tier's leading run
    held: float | None  # blocks held now (L1/L2)
    capacity: float | None
    evictions: float
    seconds_saved: float | None  # KV tiers only: None for the response caches, which time no recompute
    seconds_lost: float | None  # loads slower than recomputing would have been
    errors: float  # Redis unreachable, slow or failing
    bad_values: float  # corrupt, incompatible or half-evicted values, deleted
    refused_writes: float  # writes a full or read-only Redis refused (reads went on)
    decisions: dict[str, float] | None = None  # L3: chains loaded, recomputed (cheaper), loaded to explore
    page_locked: float | None = None  # L2 on CUDA: 0 when CUDA refused to lock its pages

    @property
    def hit_rate(self) -> float | None:
        if self.misses is None or self.hits + self.misses == 0:
            return None
        return self.hits / (self.hits + self.misses)

    @property
    def fill(self) -> float | None:
        return None if not self.capacity or self.held is None else self.held / self.capacity


# L3 and the exact cache have no evictions of their own (Redis evicts at maxmemory: `python -m client
# cache --redis-url`); what the engine deletes there is a tenant quota's trim
EVICTION_COUNTER = {"l3": "quota_evictions", "exact": "quota_evictions"}
KV_TIERS = ("l1", "l2", "l3")  # the tiers that price a reuse against recomputing it (seconds saved, lost)


def hits(tier: str, counter) -> float:
    return sum(map(counter, L3_SERVED)) if tier == "l3" else counter(HIT_COUNTER.get(tier, "hits"))


def misses(tier: str, counter) -> float:
    return sum(map(counter, L3_NOT_SERVED)) if tier == "l3" else counter(MISS_COUNTER.get(tier, "misses"))


def tier_rows(metrics: dict[str, float]) -> list[TierRow]:
    """One row per tier the engine reports (a tier it does not run has no samples)."""
    rows = []
    for tier in TIERS:
        if not any(f'tier="{tier}"' in key for key in metrics if key.startswith("llm_engine_cache_")):
            continue

        def counter(name: str, tier: str = tier) -> float:
            return metric_total(metrics, "llm_engine_cache_total", tier=tier, counter=name)

        def gauge(name: str, tier: str = tier) -> float | None:
            present = any(f'gauge="{name}"' in key and f'tier="{tier}"' in key for key in metrics)
            return metric_total(metrics, "llm_engine_cache_state", tier=tier, gauge=name) if present else None

        rows.append(
            TierRow(
                tier=tier,
                unit=UNITS[tier],
                hits=hits(tier, counter),
                misses=misses(tier, counter),
                held=gauge("blocks"),
                capacity=gauge("capacity_blocks"),
                evictions=counter(EVICTION_COUNTER.get(tier, "evictions")),
                seconds_saved=counter("seconds_saved") if tier in KV_TIERS else None,
                seconds_lost=counter("seconds_lost_slow_load") if tier in KV_TIERS else None,
                errors=counter("errors"),
                bad_values=sum(counter(name) for name in BAD_COUNTERS),
                refused_writes=counter("full_refusals") + counter("readonly_refusals"),
                decisions={name: counter(f"decision_{name}") for name in DECISIONS} if tier == "l3" else None,
                page_locked=gauge("page_locked"),
            )
        )
    return rows


def _figure(value: float | None, fmt: str = "{:g}") -> str:
    return "-" if value is None else fmt.format(value)


def format_rows(rows: list[TierRow]) -> str:
    headers = ["tier", "hits", "misses", "hit rate", "held / capacity", "evictions", "saved s", "lost s",
               "errors", "bad values", "refused writes"]  # fmt: skip
    body = []
    for row in rows:
        held = "-" if row.capacity is None else f"{_figure(row.held)} / {row.capacity:g}"
        held += "" if row.fill is None else f" ({row.fill:.0%})"
        body.append([
            row.tier, f"{row.hits:g} {row.unit}", _figure(row.misses), _figure(row.hit_rate, "{:.1%}"), held,
            f"{row.evictions:g}", _figure(row.seconds_saved, "{:.3f}"), _figure(row.seconds_lost, "{:.3f}"),
            f"{row.errors:g}",
            f"{row.bad_values:g}", f"{row.refused_writes:g}",
        ])  # fmt: skip
    widths = [max(len(str(line[i])) for line in [headers, *body]) for i in range(len(headers))]
    lines = [headers, ["-" * width for width in widths], *body]
    table = "\n".join("  ".join(str(c).ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)
    for row in rows:
        if row.page_locked == 0:
            table += (
                f"\n{row.tier} is pageable: CUDA refused to lock its pages (the engine's log has the "
                "load), so its copies to and from the GPU stage through a buffer and wait"
            )
        if row.decisions is not None:
            d = row.decisions
            table += (
                f"\nl3 chains Redis held: {d['load']:g} loaded, {d['recompute']:g} recomputed (cheaper than "
                f"loading, by the cost model), {d['explore']:g} loaded to re-measure Redis"
            )
    return table


def as_dicts(rows: list[TierRow]) -> list[dict]:
    return [{**asdict(row), "hit_rate": row.hit_rate, "fill": row.fill} for row in rows]


@dataclass(frozen=True)
class RedisMemory:
    """The shared tier's own state: how full the Redis is and what it has evicted to stay under its bound."""

    used_bytes: int
    maxmemory: int  # 0: unbounded
    policy: str
    evicted_keys: int
    expired_keys: int
    topology: str = "standalone"  # RedisTopology.describe()

    def describe(self) -> str:
        used = human(self.used_bytes)
        bound = "no maxmemory (unbounded)" if not self.maxmemory else (
            f"of {human(self.maxmemory)} ({self.used_bytes / self.maxmemory:.0%})"
        )  # fmt: skip
        return (
            f"redis: {used} {bound}, policy {self.policy}; {self.evicted_keys} keys evicted, "
            f"{self.expired_keys} expired; {self.topology}"
        )


def redis_memory(client) -> RedisMemory:
    """From INFO; raises redis errors, and UnsupportedRedis for a cluster the caches cannot use."""
    from cache.redis_topology import probe_topology

    topology = probe_topology(client).describe()
    memory, stats = client.info("memory"), client.info("stats")
    return RedisMemory(
        used_bytes=int(memory["used_memory"]),
        maxmemory=int(memory.get("maxmemory", 0)),
        policy=str(memory.get("maxmemory_policy", "unknown")),
        evicted_keys=int(stats.get("evicted_keys", 0)),
        expired_keys=int(stats.get("expired_keys", 0)),
        topology=topology,
    )
