"""One flat view of every cache tier's cumulative counters, for metrics (item 9 of the cache issue)."""

from __future__ import annotations

from dataclasses import asdict, fields

from cache.key_directory import KeyDirectory, KeyDirectoryStats

from engine.prefix_cache import PrefixCache
from engine.response_tier import ResponseTier

# seconds_saved: sum over reuses of (predicted recompute - load time) where positive;
# seconds_lost_slow_load and slow_loads: the excess and the count where the load took longer
REUSE_COUNTERS = ("tokens_loaded", "seconds_saved", "seconds_lost_slow_load", "slow_loads")
# probes: round trips asking which blocks of a prompt Redis holds (when it arrives, or in its lookup
# when that probe was not usable), probe_seconds their time
L3_COUNTERS = (
    "hits", "misses", "checksum_failures", "incompatible", "errors", "bytes_loaded", "load_seconds",
    "probes", "probe_seconds", "local_probes", "full_refusals", "readonly_refusals", "full_skips",
    "quota_evictions", "renewals", "bad_indexes",
)  # fmt: skip
# the key directories' cumulative counters (cache/key_directory.py), as "directory_<name>"
DIRECTORY_COUNTERS = tuple(f.name for f in fields(KeyDirectoryStats))


def directory_counters(tier: str, directory: KeyDirectory | None) -> dict[tuple[str, str], float]:
    if directory is None:
        return {}
    counts = directory.snapshot()
    return {(tier, f"directory_{name}"): counts[name] for name in DIRECTORY_COUNTERS}


def cache_gauges(prefix: PrefixCache | None, responses: ResponseTier | None) -> dict[tuple[str, str], float]:
    """{(tier, gauge): value now}: blocks held in L1/L2 and their capacity (blocks, bytes), on CUDA whether
    L2 is page-locked, each key directory's size and whether it is synced (0: every lookup of that tier
    goes to Redis)."""
    out: dict[tuple[str, str], float] = {}
    directories: list[tuple[str, KeyDirectory | None]] = []
    if prefix is not None:
        out[("l1", "blocks")] = len(prefix.index)
        out[("l1", "capacity_blocks")], out[("l1", "capacity_bytes")] = prefix.capacity, prefix.bytes
        if prefix.l2 is not None:
            out[("l2", "blocks")] = len(prefix.l2.index)
            out[("l2", "capacity_blocks")] = len(prefix.l2.pool)
            out[("l2", "capacity_bytes")] = prefix.l2.bytes
            if prefix.pool.is_cuda:  # 0: CUDA refused to lock L2's pages, its copies stage and wait
                out[("l2", "page_locked")] = float(prefix.l2.page_locked)
        if prefix.l3 is not None:
            directories.append(("l3", prefix.l3.store.directory))
    if responses is not None:
        directories.append(("exact", responses.cache.directory))
    for tier, directory in directories:
        if directory is not None:
            out[(tier, "directory_keys")] = len(directory)
            out[(tier, "directory_synced")] = float(directory.synced)
    return out


def cache_counters(
    prefix: PrefixCache | None, responses: ResponseTier | None
) -> dict[tuple[str, str], float]:
    """{(tier, counter): cumulative value}; tiers: l1, l2, l3, exact, semantic, and prefix (the prefix
    cache's bookkeeping time: what every request pays for it, hit or miss)."""
    out: dict[tuple[str, str], float] = {}
    if prefix is not None:
        block_bytes = prefix.bytes // max(1, prefix.capacity)
        out[("l1", "hit_blocks")] = prefix.hit_blocks
        out[("l1", "miss_blocks")] = prefix.miss_blocks
        out[("l1", "bytes_loaded")] = prefix.hit_blocks * block_bytes  # copied into the request's slot
        out[("l1", "evictions")] = prefix.evictions
        out[("prefix", "lookup_seconds")] = prefix.lookup_seconds  # the cache's own cost per request
        out[("prefix", "store_seconds")] = prefix.store_seconds
        out[("prefix", "store_cpu_seconds")] = prefix.store_cpu_seconds  # of it, the thread's CPU time
        out[("prefix", "tier_errors")] = prefix.tier_errors  # a tier raised: that lookup or store dropped
        tiers = ["l1"]
        if prefix.l2 is not None:
            out[("l2", "hit_blocks")] = prefix.l2.hits
            out[("l2", "miss_blocks")] = prefix.l2_miss_blocks
            out[("l2", "bytes_loaded")] = prefix.l2.hits * block_bytes  # host to device
            out[("l2", "evictions")] = prefix.l2.evictions
            tiers.append("l2")
        if prefix.l3 is not None:
            tiers.append("l3")
        for tier in tiers:  # time saved by reuse vs recomputing, and lost on loads slower than that
            totals = prefix.savings.totals(tier)
            for name in REUSE_COUNTERS:
                out[(tier, name)] = getattr(totals, name)
        if prefix.l3 is not None:
            stats = asdict(prefix.l3.store.stats)
            for name in L3_COUNTERS:
                out[("l3", name)] = stats[name]
            out[("l3", "probe_wait_seconds")] = prefix.l3.probe_wait_seconds  # the probe's part in lookup
            out[("l3", "probes_dropped")] = prefix.l3.probes_dropped  # their request ended before it ran
            out[("l3", "writes_dropped")] = prefix.l3.writes_dropped
            out[("l3", "writes_failed")] = prefix.l3.writes_failed
            out.update(directory_counters("l3", prefix.l3.store.directory))
            for decision, count in prefix.l3.cost.decisions.items():
                out[("l3", f"decision_{decision}")] = count
            for outcome, count in prefix.l3.outcomes.items():
                out[("l3", f"chains_{outcome}")] = count
    if responses is not None:
        for name, value in responses.cache.snapshot().items():
            out[("exact", name)] = value
        out.update(directory_counters("exact", responses.cache.directory))
        out[("exact", "first_sightings")] = responses.first_sightings  # answers not written (yet)
        out[("exact", "writes_dropped")] = responses.writes_dropped  # exact and semantic writes given up
        out[("exact", "writes_failed")] = responses.writes_failed  # and those that raised
        out[("exact", "request_seconds")] = responses.request_seconds  # lookup + remember: every request's
        out[("exact", "claimed_keys")] = responses.claimed_keys  # keys the scheduler step hashed, used
        out[("exact", "foreign_keys")] = responses.foreign_keys  # of another fingerprint: hashed here instead
        out[("exact", "forged_keys")] = responses.forged_keys  # not their prompt's when checked: refused
        if responses.semantic is not None:
            for name, value in responses.semantic.snapshot().items():
                out[("semantic", name)] = value
    return out
