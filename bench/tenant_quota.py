"""One tenant's L3 writes against another's hot blocks in a bounded Redis, with and without a tenant quota.

A bounded Redis (`maxmemory`, `volatile-lru`, as the launcher starts it) evicts whoever's values were used
least recently. A tenant that writes more KV blocks between two uses of another tenant's hot prefix than
Redis holds pushes that prefix out, and every replica recomputes it. `l3_tenant_max_blocks` makes a
tenant's writes past its quota delete its own oldest blocks instead (`cache/key_directory.py`).

Per mode (no quota, quota), on a fresh redis-server of its own: tenant `acme` writes its hot chains once;
then each round tenant `flood` writes new chains (more bytes per round than Redis holds, by default), and
`acme` reads its chains back, as its traffic would. Reported: `acme`'s blocks served per round, what
each tenant holds at the end, Redis's own evictions, the quota's deletions, and the median time of one
chain write (the quota adds a script to that round trip).

    python -m bench.tenant_quota [--maxmemory 48mb] [--rounds 12] [--flood-blocks-per-round 1000]
Writes bench/results/tenant-quota-<tag>.{json,md,png}.
"""

from __future__ import annotations

import argparse
import hashlib
import shlex
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import redis
import torch

from bench.common import link_plot, median, print_table, progress, write_results
from cache.kv_format import KVBlockMeta
from cache.redis_kv_store import RedisKVStore
from deploy.launch import find_free_port, start_redis_server

SHAPE = (4, 2, 4, 16, 64)  # layers, k/v, kv heads, tokens, head dim: 64 KiB a block in float16
META = KVBlockMeta("bench-quota", "float16", SHAPE, SHAPE[3], "L2HBD-v1")
CHAIN = 8  # blocks per written chain (one prompt's new blocks)


@dataclass
class ModeResult:
    mode: str
    quota_blocks: int
    acme_served: list[float] = field(default_factory=list)  # per round: acme's blocks read back / its blocks
    acme_held: int = 0
    flood_held: int = 0
    redis_evicted: int = 0
    quota_evictions: int = 0
    write_ms: float = 0.0  # median of one chain write (flood's)


def chain_keys(tenant: str, chain: int) -> list[bytes]:
    return [hashlib.sha256(f"{tenant}|{chain}|{i}".encode()).digest() for i in range(CHAIN)]


def block(seed: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed)).to(torch.float16)


def run_mode(args, quota: int, work_dir: Path) -> ModeResult:
    port = find_free_port()
    process, _ = start_redis_server("redis-server", work_dir, port, args.maxmemory)
    url = f"redis://127.0.0.1:{port}/0"
    result = ModeResult("quota" if quota else "no quota", quota)
    store = RedisKVStore(url, "llm:kv:v1:bench-quota", timeout_s=1.0, tenant_max_blocks=quota)
    raw = redis.Redis.from_url(url)
    try:
        blocks = [block(i) for i in range(CHAIN)]
        acme = [chain_keys("acme", c) for c in range(args.acme_chains)]
        for keys in acme:
            store.put_chain(keys, blocks, META, tenant="acme")
        written, times = 0, []
        for round_no in range(args.rounds):
            for _ in range(args.flood_blocks_per_round // CHAIN):
                started = time.perf_counter()
                store.put_chain(chain_keys("flood", written), blocks, META, tenant="flood")
                times.append(time.perf_counter() - started)
                written += 1
            served = sum(len(store.get_chain(keys, META)) for keys in acme)
            result.acme_served.append(served / (len(acme) * CHAIN))
            progress(f"{result.mode}: round {round_no + 1}/{args.rounds}, acme served {served} blocks")
        result.acme_held = sum(raw.exists(store.redis_key(k)) for keys in acme for k in keys)
        result.flood_held = sum(
            raw.exists(*[store.redis_key(k) for k in chain_keys("flood", c)]) for c in range(written)
        )
        result.redis_evicted = int(raw.info("stats")["evicted_keys"])
        result.quota_evictions = store.stats.quota_evictions
        result.write_ms = median(times) * 1e3
    finally:
        raw.close()
        store.close()
        process.terminate()
        process.wait(timeout=10)
    return result


def plot(results: list[ModeResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        ax.plot(range(1, len(r.acme_served) + 1), [100 * s for s in r.acme_served], marker="o", label=r.mode)
    ax.set_xlabel("round (flood writes, then acme reads its hot chains)")
    ax.set_ylabel("acme's hot blocks served from L3 (%)")
    ax.set_ylim(-5, 105)
    ax.legend()
    ax.set_title("One tenant's flood against another's hot L3 blocks, bounded Redis")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tenant_quota", description=__doc__.split("\n")[0])
    parser.add_argument("--maxmemory", default="48mb", help="the bounded Redis's maxmemory")
    parser.add_argument("--acme-chains", type=int, default=8, help="acme's hot chains of 8 blocks")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--flood-blocks-per-round", type=int, default=1000, help="64 KiB blocks")
    parser.add_argument("--quota", type=int, default=256, help="l3_tenant_max_blocks in the quota mode")
    parser.add_argument("--tag", default="cpu")
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-quota-") as tmp:
        for quota in (0, args.quota):
            work_dir = Path(tmp) / f"quota-{quota}"
            work_dir.mkdir()
            results.append(run_mode(args, quota, work_dir))
    headers = [
        "mode", "acme served, last round", "acme served, mean of rounds", "acme blocks held",
        "flood blocks held", "Redis evictions", "quota deletions", "chain write ms (median)",
    ]  # fmt: skip
    rows = [
        [
            f"quota {r.quota_blocks} blocks" if r.quota_blocks else r.mode,
            f"{100 * r.acme_served[-1]:.0f}%",
            f"{100 * sum(r.acme_served) / len(r.acme_served):.0f}%",
            r.acme_held, r.flood_held, r.redis_evicted, r.quota_evictions, f"{r.write_ms:.3f}",
        ]
        for r in results
    ]  # fmt: skip
    table = print_table(headers, rows)
    per_round = args.flood_blocks_per_round
    note = (
        f"\n{args.acme_chains * CHAIN} hot blocks of tenant acme (64 KiB each), written once; each round "
        f"tenant flood writes {per_round} new blocks ({per_round * 64 // 1024} MiB) into a Redis of "
        f"maxmemory {args.maxmemory} (volatile-lru), then acme reads its chains back.\n"
    )
    print(note)
    command = "python -m bench.tenant_quota " + shlex.join(sys.argv[1:] if argv is None else argv)
    payload = {"results": [asdict(r) for r in results], "args": vars(args)}
    base = write_results(
        "tenant-quota", args.tag, payload, table + "\n" + note, command.strip(), results_dir=args.out_dir
    )
    plot(results, base.with_suffix(".png"))
    link_plot(base)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
