"""One flat view of every cache tier's cumulative counters, for metrics (item 9 of the cache issue)."""

from __future__ import annotations

from dataclasses import asdict

from engine.prefix_cache import PrefixCache
from engine.response_tier import ResponseTier


def cache_counters(
    prefix: PrefixCache | None, responses: ResponseTier | None
) -> dict[tuple[str, str], float]:
    """{(tier, counter): cumulative value}; tiers: l1, l2, l3, exact, semantic."""
    out: dict[tuple[str, str], float] = {}
    if prefix is not None:
        out[("l1", "hit_blocks")] = prefix.hit_blocks
        out[("l1", "evictions")] = prefix.evictions
        if prefix.l2 is not None:
            out[("l2", "hit_blocks")] = prefix.l2.hits
            out[("l2", "evictions")] = prefix.l2.evictions
        if prefix.l3 is not None:
            stats = asdict(prefix.l3.store.stats)
            for name in ("hits", "misses", "checksum_failures", "incompatible", "errors", "bytes_loaded"):
                out[("l3", name)] = stats[name]
            out[("l3", "load_seconds")] = stats["load_seconds"]
            for decision, count in prefix.l3.cost.decisions.items():
                out[("l3", f"decision_{decision}")] = count
    if responses is not None:
        for name, value in responses.cache.snapshot().items():
            out[("exact", name)] = value
        if responses.semantic is not None:
            for name, value in responses.semantic.snapshot().items():
                out[("semantic", name)] = value
    return out
