"""Semantic cache precision and hit rate on the shipped paraphrase set (issue 4, benchmark d).

Stores the "a" side of every pair of data/paraphrases.jsonl in one tenant of a real redis-server
(started here on a free port, stopped at the end), then looks up every "b" side through
SemanticResponseCache.lookup, for a sweep of thresholds, with and without the guard.

- a hit is correct when the returned entry is the labeled true paraphrase of the query (its pair's "a"
  with same=true); any other entry, labeled negative or unlabeled, counts as wrong (conservative);
- precision = correct hits / all hits; hit rate = correct hits on true pairs / all true pairs.

Chooses the threshold with the highest hit rate subject to precision >= --min-precision (guard on).
Writes bench/results/semantic-cache-<tag>.{json,md,png}.

    python -m bench.semantic_cache
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from cache.embedder import MiniLMEmbedder
from cache.semantic_cache import SemanticResponseCache
from deploy.launch import find_free_port, start_redis_server
from scheduler.messages import EngineRequestParams

REPO_ROOT = Path(__file__).resolve().parents[1]
DATA = REPO_ROOT / "data" / "paraphrases.jsonl"
RESULTS = REPO_ROOT / "bench" / "results"
TENANT = "bench"


@dataclass(frozen=True)
class Pair:
    a: str
    b: str
    same: bool
    kind: str


@dataclass
class SweepPoint:
    threshold: float
    guard: bool
    hits: int
    correct_hits: int
    true_pairs: int
    correct_on_true: int
    wrong_by_kind: dict[str, int]

    @property
    def precision(self) -> float:
        return self.correct_hits / self.hits if self.hits else 1.0

    @property
    def hit_rate(self) -> float:
        return self.correct_on_true / self.true_pairs if self.true_pairs else 0.0

    def row(self) -> dict:
        return {**asdict(self), "precision": self.precision, "hit_rate": self.hit_rate}


def load_pairs(path: Path) -> list[Pair]:
    pairs = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            d = json.loads(line)
            pairs.append(Pair(d["a"], d["b"], bool(d["same"]), d["kind"]))
    return pairs


def sweep(
    cache: SemanticResponseCache,
    pairs: list[Pair],
    query_vecs: np.ndarray,
    thresholds: list[float],
    guard: bool,
    params: EngineRequestParams,
) -> list[SweepPoint]:
    true_match = {(p.a, p.b) for p in pairs if p.same}
    cache.use_guard = guard
    points = []
    for t in thresholds:
        hits = correct = correct_true = 0
        wrong: Counter[str] = Counter()
        for pair, vec in zip(pairs, query_vecs):
            hit = cache.lookup(pair.b, TENANT, params, embedding=vec, threshold=t)
            if hit is None:
                continue
            hits += 1
            ok = (hit.prompt, pair.b) in true_match
            if ok:
                correct += 1
                correct_true += int(pair.same)
            else:
                wrong[pair.kind if not pair.same else "paraphrase:other-entry"] += 1
        points.append(
            SweepPoint(
                round(t, 3), guard, hits, correct, sum(p.same for p in pairs), correct_true, dict(wrong)
            )
        )
    return points


def choose(points: list[SweepPoint], min_precision: float) -> SweepPoint | None:
    ok = [p for p in points if p.precision >= min_precision and p.hits > 0]
    return max(ok, key=lambda p: (p.hit_rate, p.precision, -p.threshold)) if ok else None


def plot(points: list[SweepPoint], chosen: SweepPoint | None, min_precision: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for guard, style in ((True, "-"), (False, "--")):
        pts = [p for p in points if p.guard == guard]
        label = "guard on" if guard else "guard off"
        ax.plot(
            [p.threshold for p in pts],
            [p.precision for p in pts],
            style,
            color="C0",
            label=f"precision ({label})",
        )
        ax.plot(
            [p.threshold for p in pts],
            [p.hit_rate for p in pts],
            style,
            color="C1",
            label=f"hit rate ({label})",
        )
    ax.axhline(min_precision, color="grey", lw=0.8, ls=":", label=f"precision target {min_precision:.2f}")
    if chosen is not None:
        ax.axvline(chosen.threshold, color="C2", lw=1, label=f"chosen threshold {chosen.threshold:.2f}")
    ax.set_xlabel("cosine threshold")
    ax.set_ylabel("fraction")
    ax.set_ylim(0, 1.02)
    ax.set_title("Semantic cache on data/paraphrases.jsonl (all-MiniLM-L6-v2)")
    ax.legend(loc="lower left", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table(points: list[SweepPoint], chosen: SweepPoint | None, every: float) -> str:
    by_t: dict[float, dict[bool, SweepPoint]] = {}
    for p in points:
        by_t.setdefault(p.threshold, {})[p.guard] = p
    lines = [
        "| threshold | precision (guard) | hit rate (guard) | hits (guard) | wrong (guard) "
        "| precision (no guard) | hit rate (no guard) | wrong (no guard) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for t in sorted(by_t):
        g, n = by_t[t][True], by_t[t][False]
        show = abs((t / every) - round(t / every)) < 1e-6 or (chosen and t == chosen.threshold)
        if not show:
            continue
        mark = " **chosen**" if chosen and t == chosen.threshold else ""
        lines.append(
            f"| {t:.2f}{mark} | {g.precision:.3f} | {g.hit_rate:.3f} | {g.hits} | {g.hits - g.correct_hits} "
            f"| {n.precision:.3f} | {n.hit_rate:.3f} | {n.hits - n.correct_hits} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--tag", default="cpu")
    ap.add_argument("--min-precision", type=float, default=0.97)
    ap.add_argument("--lo", type=float, default=0.50)
    ap.add_argument("--hi", type=float, default=0.99)
    ap.add_argument("--step", type=float, default=0.01)
    ap.add_argument("--redis-server", default="redis-server")
    ap.add_argument("--results-dir", type=Path, default=RESULTS)
    args = ap.parse_args(argv)

    pairs = load_pairs(args.data)
    kinds = Counter(p.kind for p in pairs)
    print(f"{len(pairs)} pairs from {args.data.name}: {dict(kinds)}", flush=True)
    t0 = time.perf_counter()
    embedder = MiniLMEmbedder()
    load_s = time.perf_counter() - t0
    stored = sorted({p.a for p in pairs})
    t0 = time.perf_counter()
    stored_vecs = embedder.embed(stored)
    query_vecs = embedder.embed([p.b for p in pairs])
    embed_ms = (time.perf_counter() - t0) * 1000 / (len(stored) + len(pairs))
    params = EngineRequestParams(max_tokens=64, temperature=0.0)
    thresholds = [round(x, 3) for x in np.arange(args.lo, args.hi + 1e-9, args.step)]

    with tempfile.TemporaryDirectory(prefix="bench-semcache-") as tmp:
        port = find_free_port()
        proc, _ = start_redis_server(args.redis_server, Path(tmp), port)
        try:
            cache = SemanticResponseCache(f"redis://localhost:{port}/0", "bench-model", embedder)
            for text, vec in zip(stored, stored_vecs):
                if not cache.store(text, TENANT, params, f"answer to: {text}", embedding=vec):
                    raise RuntimeError("store failed against the bench's own redis-server")
            t0 = time.perf_counter()
            points = sweep(cache, pairs, query_vecs, thresholds, True, params)
            lookup_us = (time.perf_counter() - t0) * 1e6 / (len(thresholds) * len(pairs))
            points += sweep(cache, pairs, query_vecs, thresholds, False, params)
            stats = cache.snapshot()
            cache.close()
        finally:
            proc.terminate()
            proc.wait(timeout=10)

    guarded = [p for p in points if p.guard]
    chosen = choose(guarded, args.min_precision)
    best_unguarded = choose([p for p in points if not p.guard], args.min_precision)
    md_table = table(points, chosen, every=0.05)
    print(md_table)
    summary = {
        "pairs": len(pairs),
        "kinds": dict(kinds),
        "stored_entries": len(stored),
        "min_precision": args.min_precision,
        "chosen": chosen.row() if chosen else None,
        "best_without_guard": best_unguarded.row() if best_unguarded else None,
        "targets_met": bool(chosen and chosen.precision >= 0.97 and chosen.hit_rate >= 0.60),
        "model_load_s": round(load_s, 2),
        "embed_ms_per_text_batched": round(embed_ms, 2),
        "lookup_us_guard_on_precomputed_embedding": round(lookup_us, 1),
        "cache_stats": stats,
    }
    if chosen:
        print(
            f"chosen threshold {chosen.threshold:.2f}: precision {chosen.precision:.3f}, "
            f"hit rate {chosen.hit_rate:.3f} ({chosen.correct_on_true}/{chosen.true_pairs}), "
            f"wrong hits {chosen.hits - chosen.correct_hits} {chosen.wrong_by_kind}"
        )
    else:
        print(f"no threshold reaches precision {args.min_precision}")
    if best_unguarded:
        print(
            f"without the guard: best threshold {best_unguarded.threshold:.2f}, precision "
            f"{best_unguarded.precision:.3f}, hit rate {best_unguarded.hit_rate:.3f}"
        )
    else:
        print(f"without the guard no threshold reaches precision {args.min_precision}")

    args.results_dir.mkdir(parents=True, exist_ok=True)
    base = args.results_dir / f"semantic-cache-{args.tag}"
    command = "python -m bench.semantic_cache " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    meta = {"command": command.strip(), "machine": platform.node(), "date": stamp}
    payload = {**meta, "summary": summary, "sweep": [p.row() for p in points]}
    base.with_suffix(".json").write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    plot(points, chosen, args.min_precision, base.with_suffix(".png"))
    chosen_line = (
        f"Chosen threshold (guard on, max hit rate with precision >= {args.min_precision}): "
        f"**{chosen.threshold:.2f}**: precision **{chosen.precision:.3f}**, "
        f"hit rate **{chosen.hit_rate:.3f}** "
        f"({chosen.correct_on_true}/{chosen.true_pairs} true pairs), wrong hits: {chosen.wrong_by_kind or 0}."
        if chosen
        else f"No threshold reaches precision {args.min_precision}."
    )
    unguarded_line = (
        f"Without the guard the best is {best_unguarded.threshold:.2f}: precision "
        f"{best_unguarded.precision:.3f}, hit rate {best_unguarded.hit_rate:.3f}."
        if best_unguarded
        else f"Without the guard no threshold reaches precision {args.min_precision}."
    )
    data_name = args.data.relative_to(REPO_ROOT) if args.data.is_relative_to(REPO_ROOT) else args.data
    md = (
        f"# semantic cache ({args.tag})\n\n- command: `{meta['command']}`\n- machine: {meta['machine']}\n"
        f"- date: {stamp}\n- data: {data_name}"
        f" ({len(pairs)} pairs: {dict(kinds)}); {len(stored)} distinct 'a' prompts stored in one tenant of a "
        f"real redis-server, every 'b' looked up\n"
        "- a hit counts as correct only when it returns the labeled true paraphrase; "
        "anything else is wrong\n"
        f"- model load {load_s:.1f} s, embedding {embed_ms:.1f} ms/text (batched, CPU), lookup "
        f"{lookup_us:.0f} us with a precomputed embedding (Redis version check + cosine + guard)\n\n"
        f"Issue targets (precision >= 0.97 with hit rate >= 0.60): "
        f"{'met' if summary['targets_met'] else 'NOT met'}.\n\n"
        f"{chosen_line}\n\n{unguarded_line}\n\n{md_table}\n\n![plot](semantic-cache-{args.tag}.png)\n"
    )
    base.with_suffix(".md").write_text(md, encoding="utf-8")
    print(f"wrote {base}.{{json,md,png}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
