"""(b) pooled over several saved runs of bench.prefix_cache: one run's median of 30 rounds moves by about
±0.6% from run to run under load, as much as the cost it measures, so the runs' rounds are pooled and
the median's 95% confidence interval is bootstrapped (percentile method, fixed seed: the same files give
the same report). Every input must come from the same command on the same machine kind; pooling
differently sized turns would mix different costs.

    python -m bench.prefix_cache_pool bench/results/prefix-cache-throughput-h200*.json --tag h200
Writes bench/results/prefix-cache-pooled-<tag>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.common import median, print_table, progress, write_results
from bench.prefix_cache import COMPARISONS, round_costs

MODES = (("throughput", "one at a time"), ("throughput_concurrent", "under load"))
CONTROL = "A/A control: bypassed vs bypassed"


@dataclass(frozen=True)
class Pooled:
    mode: str
    comparison: str
    runs: int
    costs: list[float]  # every round's cost, all runs together


def pooled_costs(runs: list[dict]) -> list[Pooled]:
    """Per mode that the runs measured, each comparison's round costs (COMPARISONS, then the A/A control)."""
    out = []
    for key, mode in MODES:
        parts = [run[key] for run in runs if run.get(key)]
        if not parts:
            continue
        for label, arm in COMPARISONS:
            pairs = [[(r[arm], r["bypass"]) for r in part["rounds"]] for part in parts]
            costs = [c for run_pairs in pairs for c in round_costs(run_pairs)]
            out.append(Pooled(mode, label, len(parts), costs))
        control = [c for part in parts for c in round_costs([tuple(pair) for pair in part["control"]])]
        out.append(Pooled(mode, CONTROL, len(parts), control))
    return out


def median_interval(values: list[float], resamples: int = 4000, seed: int = 0) -> tuple[float, float]:
    """The median's 95% interval by the percentile bootstrap."""
    rng = random.Random(seed)
    medians = sorted(median(rng.choices(values, k=len(values))) for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def report_rows(pooled: list[Pooled]) -> list[list[object]]:
    rows = []
    for p in pooled:
        low, high = median_interval(p.costs)
        mean = sum(p.costs) / len(p.costs)
        rows.append([p.mode, p.comparison, p.runs, len(p.costs), f"{median(p.costs) * 100:.2f}%",
                     f"{low * 100:.2f}% to {high * 100:.2f}%", f"{mean * 100:.2f}%"])  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("runs", nargs="+", type=Path, help="JSON files that bench.prefix_cache wrote")
    parser.add_argument("--tag", required=True, help="names the report: prefix-cache-pooled-<tag>")
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    runs = [json.loads(path.read_text(encoding="utf-8")) for path in args.runs]
    seen: dict[str, Path] = {}  # a run given twice (or its copy) would count its rounds twice
    for path, run in zip(args.runs, runs):
        rounds = json.dumps([run.get(key) for key, _ in MODES], sort_keys=True)
        if rounds in seen:
            parser.error(f"{path} holds the same rounds as {seen[rounds]}: a run is pooled once")
        seen[rounds] = path
    machines = sorted({run.get("machine", "?") for run in runs})
    if len(machines) > 1:
        parser.error(f"the runs come from different machines: {machines}")
    for key, mode in MODES:  # runs before 2026-12-07 did not record it one at a time: not checked
        sizes = sorted(
            {run[key]["requests_per_turn"] for run in runs if (run.get(key) or {}).get("requests_per_turn")}
        )
        if len(sizes) > 1:
            parser.error(f"the runs' turns {mode} are of different sizes: {sizes} requests")
        clients = sorted({run[key]["concurrency"] for run in runs if (run.get(key) or {}).get("concurrency")})
        if len(clients) > 1:  # 16 clients for 8 slots measure capacity, 8 a latency-bound load
            parser.error(f"the runs {mode} ran different numbers of clients: {clients}")
    progress(f"pooling {len(runs)} runs of {machines[0]}")
    pooled = pooled_costs(runs)
    table = print_table(
        ["mode", "comparison", "runs", "rounds", "cost: median of all rounds", "95% interval of that median",
         "cost: mean of rounds"],
        report_rows(pooled),
    )  # fmt: skip
    sources = "\n".join(f"- `{path}`: {run.get('date', '?')}, `{run.get('command', '?')}`" for path, run in
                        zip(args.runs, runs))  # fmt: skip
    text = f"Runs pooled:\n{sources}\n\n{table}"
    command = "python -m bench.prefix_cache_pool " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])
    )
    payload = {"runs": [str(p) for p in args.runs], "pooled": [p.__dict__ for p in pooled]}
    base = write_results("prefix-cache-pooled", args.tag, payload, text, command, args.out_dir, machines[0])
    progress(f"wrote {base}.json/.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
