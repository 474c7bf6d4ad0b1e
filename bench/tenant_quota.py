"""One tenant's writes against another's hot entries in a bounded Redis, with and without a tenant quota.

A bounded Redis (`maxmemory`, `volatile-lru`, as the launcher starts it) evicts whoever's values were used
least recently. A tenant that writes more between two uses of another tenant's hot entries than Redis
holds pushes them out, and every replica recomputes them. A tenant quota makes a tenant's writes past it
delete its own least recently used entries instead (`cache/key_directory.py`): `l3_tenant_max_blocks`
for KV blocks (`--cache kv`), `exact_tenant_max_entries` for exact answers (`--cache exact`).

Per mode (no quota, quota), on a fresh redis-server of its own: tenant `acme` writes its hot entries
once; then each round tenant `flood` writes new ones (more bytes per round than Redis holds, by default),
and `acme` reads its entries back, as its traffic would. Reported: `acme`'s entries served per round,
what each tenant holds at the end, Redis's own evictions, the quota's deletions, and the median time of
one write (the quota adds a script to that round trip).

    python -m bench.tenant_quota [--cache kv] [--maxmemory 48mb] [--rounds 12] [--flood-per-round 125]
    python -m bench.tenant_quota --cache exact [--maxmemory 8mb] [--flood-per-round 6000]
Writes bench/results/tenant-quota-<tag>.{json,md,png} (`tenant-quota-exact-<tag>` for exact answers).
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
from cache.response_cache import ExactAnswer, ExactResponseCache, canonical_json
from deploy.launch import find_free_port, start_redis_server
from scheduler.messages import EngineRequestParams

SHAPE = (4, 2, 4, 16, 64)  # layers, k/v, kv heads, tokens, head dim: 64 KiB a block in float16
META = KVBlockMeta("bench-quota", "float16", SHAPE, SHAPE[3], "L2HBD-v1")
CHAIN = 8  # blocks per written chain (one prompt's new blocks)
ANSWER = ExactAnswer(tuple(range(1000, 1400)), 0, True)  # an exact answer: 400 tokens, ~2 KiB of JSON
ANSWER_BYTES = len(canonical_json(ANSWER.document()))
# per cache: maxmemory, acme's hot entries, flood's writes per round, the quota (in the cache's units)
DEFAULTS = {"kv": ("48mb", 8, 125, 256), "exact": ("8mb", 64, 6000, 1024)}


@dataclass
class ModeResult:
    mode: str
    quota: int  # in the cache's units (blocks or answers)
    acme_served: list[float] = field(default_factory=list)  # per round: acme's units read back / its units
    acme_held: int = 0
    flood_held: int = 0
    redis_evicted: int = 0
    quota_evictions: int = 0
    write_ms: float = 0.0  # median of one write (flood's)


def chain_keys(tenant: str, chain: int) -> list[bytes]:
    return [hashlib.sha256(f"{tenant}|{chain}|{i}".encode()).digest() for i in range(CHAIN)]


def block(seed: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed)).to(torch.float16)


class KVTarget:
    """Entries are chains of CHAIN KV blocks (`RedisKVStore`); counted in blocks."""

    unit, per_entry = "blocks", CHAIN

    def __init__(self, url: str, quota: int):
        self.store = RedisKVStore(url, "llm:kv:v2:bench-quota", timeout_s=1.0, tenant_max_blocks=quota)
        self.blocks = [block(i) for i in range(CHAIN)]

    def write(self, tenant: str, n: int) -> None:
        self.store.put_chain(chain_keys(tenant, n), self.blocks, META, tenant=tenant)

    def served(self, tenant: str, n: int) -> int:
        return len(self.store.get_chain(chain_keys(tenant, n), META))

    def names(self, tenant: str, n: int) -> list[str]:
        return [self.store.redis_key(k) for k in chain_keys(tenant, n)]

    @property
    def quota_evictions(self) -> int:
        return self.store.stats.quota_evictions

    def close(self) -> None:
        self.store.close()


class ExactTarget:
    """Entries are exact answers of ~2 KiB (`ExactResponseCache`); counted in answers."""

    unit, per_entry = "answers", 1

    def __init__(self, url: str, quota: int):
        self.cache = ExactResponseCache(url, "bench-quota", timeout_s=1.0, tenant_max_entries=quota)

    @staticmethod
    def _params(tenant: str) -> EngineRequestParams:
        return EngineRequestParams(max_tokens=512, tenant=tenant)

    def write(self, tenant: str, n: int) -> None:
        self.cache.put([n], self._params(tenant), ANSWER)

    def served(self, tenant: str, n: int) -> int:
        return int(self.cache.get([n], self._params(tenant)) is not None)

    def names(self, tenant: str, n: int) -> list[str]:
        return [self.cache.key([n], self._params(tenant))]

    @property
    def quota_evictions(self) -> int:
        return self.cache.snapshot()["quota_evictions"]

    def close(self) -> None:
        self.cache.close()


TARGETS = {"kv": KVTarget, "exact": ExactTarget}


def run_mode(args, quota: int, work_dir: Path) -> ModeResult:
    port = find_free_port()
    process, _ = start_redis_server("redis-server", work_dir, port, args.maxmemory)
    url = f"redis://127.0.0.1:{port}/0"
    result = ModeResult("quota" if quota else "no quota", quota)
    target = TARGETS[args.cache](url, quota)
    raw = redis.Redis.from_url(url)
    try:
        for n in range(args.acme_entries):
            target.write("acme", n)
        written, times = 0, []
        for round_no in range(args.rounds):
            for _ in range(args.flood_per_round):
                started = time.perf_counter()
                target.write("flood", written)
                times.append(time.perf_counter() - started)
                written += 1
            served = sum(target.served("acme", n) for n in range(args.acme_entries))
            result.acme_served.append(served / (args.acme_entries * target.per_entry))
            progress(f"{result.mode}: round {round_no + 1}/{args.rounds}, acme served {served} {target.unit}")
        result.acme_held = sum(raw.exists(*target.names("acme", n)) for n in range(args.acme_entries))
        result.flood_held = sum(raw.exists(*target.names("flood", n)) for n in range(written))
        result.redis_evicted = int(raw.info("stats")["evicted_keys"])
        result.quota_evictions = target.quota_evictions
        result.write_ms = median(times) * 1e3
    finally:
        raw.close()
        target.close()
        process.terminate()
        process.wait(timeout=10)
    return result


def plot(results: list[ModeResult], path: Path, what: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        ax.plot(range(1, len(r.acme_served) + 1), [100 * s for s in r.acme_served], marker="o", label=r.mode)
    ax.set_xlabel("round (flood writes, then acme reads its hot chains)")
    ax.set_ylabel(f"acme's hot {what} served (%)")
    ax.set_ylim(-5, 105)
    ax.legend()
    ax.set_title(f"One tenant's flood against another's hot {what}, bounded Redis")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tenant_quota", description=__doc__.split("\n")[0])
    parser.add_argument("--cache", choices=sorted(TARGETS), default="kv", help="KV blocks or exact answers")
    parser.add_argument(
        "--maxmemory", default=None, help="the bounded Redis's maxmemory (kv 48mb, exact 8mb)"
    )
    parser.add_argument("--acme-entries", type=int, default=None, help="acme's hot chains or answers (8, 64)")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument(
        "--flood-per-round",
        type=int,
        default=None,
        help="flood's chains of 8 64 KiB blocks (125) or answers (6000)",
    )
    parser.add_argument(
        "--quota", type=int, default=None, help="in the cache's units: blocks (256) or answers (1024)"
    )
    parser.add_argument("--tag", default="cpu")
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    for name, default in zip(("maxmemory", "acme_entries", "flood_per_round", "quota"), DEFAULTS[args.cache]):
        if getattr(args, name) is None:
            setattr(args, name, default)
    unit = TARGETS[args.cache].unit
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-quota-") as tmp:
        for quota in (0, args.quota):
            work_dir = Path(tmp) / f"quota-{quota}"
            work_dir.mkdir()
            results.append(run_mode(args, quota, work_dir))
    headers = [
        "mode", "acme served, last round", "acme served, mean of rounds", f"acme {unit} held",
        f"flood {unit} held", "Redis evictions", "quota deletions", "write ms (median)",
    ]  # fmt: skip
    rows = [
        [
            f"quota {r.quota} {unit}" if r.quota else r.mode,
            f"{100 * r.acme_served[-1]:.0f}%",
            f"{100 * sum(r.acme_served) / len(r.acme_served):.0f}%",
            r.acme_held, r.flood_held, r.redis_evicted, r.quota_evictions, f"{r.write_ms:.3f}",
        ]
        for r in results
    ]  # fmt: skip
    table = print_table(headers, rows)
    if args.cache == "kv":
        blocks = args.flood_per_round * CHAIN
        what = f"{args.acme_entries * CHAIN} hot blocks (chains of {CHAIN}, 64 KiB a block)"
        flood = f"{blocks} new blocks ({blocks * 64 // 1024} MiB)"
    else:
        what = f"{args.acme_entries} hot exact answers ({ANSWER_BYTES} bytes of token ids each)"
        flood = (
            f"{args.flood_per_round} new answers (~{args.flood_per_round * ANSWER_BYTES >> 20} MiB of ids)"
        )
    note = (
        f"\n{what} of tenant acme, written once; each round tenant flood writes {flood} into a Redis of "
        f"maxmemory {args.maxmemory} (volatile-lru), then acme reads its entries back. Write: one chain "
        f"write (kv) or one answer's put (exact), quota script included.\n"
    )
    print(note)
    command = "python -m bench.tenant_quota " + shlex.join(sys.argv[1:] if argv is None else argv)
    payload = {"results": [asdict(r) for r in results], "args": vars(args)}
    name = "tenant-quota" if args.cache == "kv" else "tenant-quota-exact"
    base = write_results(
        name, args.tag, payload, table + "\n" + note, command.strip(), results_dir=args.out_dir
    )
    plot(results, base.with_suffix(".png"), "KV blocks" if args.cache == "kv" else "exact answers")
    link_plot(base)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
