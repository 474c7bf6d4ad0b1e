"""Shared benchmark plumbing: prompts of a given token length, TTFT probes, result files."""

from __future__ import annotations

import json
import platform
import statistics
import subprocess
import time
from dataclasses import asdict, is_dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from client.generate import GenerationResult, StreamingSession
from deploy import launch
from deploy.stack_secret import share_tenant_secret
from client.metrics import metric_total, scrape_metrics

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS = REPO_ROOT / "bench" / "results"
CORPUS = REPO_ROOT / "data" / "corpus.txt"


def model_dir_for(preset: str, model_dir: Path | None) -> Path:
    """The checkpoint a benchmark serves: `model_dir`, else models/<preset>-llama, built when missing."""
    path = model_dir or REPO_ROOT / "models" / ("tiny-llama" if preset == "tiny" else f"{preset}-llama")
    if not (path / "config.json").exists():
        from engine.build_model import build

        progress(f"building the {preset} model into {path}")
        build(preset, path)
    return path


def add_engine_args(parser, *, results: bool = True) -> None:
    """The options every server benchmark shares: what to serve, where, and where results go."""
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--preset", default="tiny", help="model preset built by engine.build_model")
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--max-seq-len", type=int, default=2048)
    parser.add_argument(
        "--text-env", type=Path, default=None, help="numpy<2 venv for the BYTES steps (GPU image)"
    )
    if results:
        parser.add_argument("--tag", default=None, help="result file tag (default: the device)")
        parser.add_argument(
            "--out-dir", type=Path, default=None, help="write results here instead of bench/results"
        )


def in_process_config(args, **overrides: Any):
    """The EngineConfig of an in-process benchmark (no Triton): model, device, dtype and sequence limit
    from `add_engine_args`'s options, no prefill templates; `overrides` set the rest."""
    from engine.config import EngineConfig  # torch and the engine: only the in-process benchmarks need them

    return EngineConfig(
        model_dir=str(model_dir_for(args.preset, args.model_dir)),
        device=args.device,
        dtype=args.dtype,
        max_seq_len=args.max_seq_len,
        prefill_templates="",
        **overrides,
    )


def engine_env(device: str, dtype: str, max_seq_len: int) -> dict[str, str]:
    """Environment the engine's config.pbtxt expands (`${LLM_DEVICE:-cpu}` and friends)."""
    return {"LLM_DEVICE": device, "LLM_DTYPE": dtype, "LLM_MAX_SEQ_LEN": str(max_seq_len)}


class PromptFactory:
    """Distinct prompts of an exact token count (BOS included), cut from the shipped corpus."""

    def __init__(self, model_dir: Path):
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.ids = self.tokenizer.encode(CORPUS.read_text(encoding="utf-8"), add_special_tokens=False).ids
        self.cursor = 0

    def make(self, tokens: int) -> str:
        """Walk the corpus so every prompt differs; re-tokenization may shift the count by a token or two."""
        want = max(1, tokens - 1)
        if self.cursor + want >= len(self.ids):
            self.cursor = 0
        text = self.tokenizer.decode(self.ids[self.cursor : self.cursor + want])
        self.cursor += want + 7
        return text

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text).ids)


PROBE_MAX_TOKENS = 4


class TtftProbe:
    """Sends requests one at a time on one long-lived gRPC stream, as a production client would.

    A fresh channel per request would add connection set-up (2-5 ms on the CPU machine) to every
    figure, and the very first one would add the process's first gRPC handshake, which is the
    client's cold start, not the server's.
    """

    def __init__(self, url: str):
        self.session = StreamingSession(url)

    def ttft_ms(self, prompt: str, **options: Any) -> float:
        """Time to the first text; `options` as `request` takes them."""
        return self.request(prompt, **options).ttft_s * 1000.0

    def first_token_ms(self, prompt: str, max_tokens: int = PROBE_MAX_TOKENS) -> tuple[float, float]:
        """(time to the first token's response, time to the first text). They differ when the first
        token ends inside a UTF-8 character: the text then waits for the next token, which says
        something about the prompt and the model's output, not about how warm the server is."""
        result = self.request(prompt, max_tokens)
        return result.first_token_s * 1000.0, result.ttft_s * 1000.0

    def request(
        self,
        prompt: str,
        max_tokens: int = PROBE_MAX_TOKENS,
        tier: str | None = None,
        tenant: str | None = None,
        cache: str | None = None,
    ) -> GenerationResult:
        sampling = {"max_tokens": max_tokens, "ignore_eos": True}
        rid = self.session.submit(prompt, sampling=sampling, tier=tier, tenant=tenant, cache=cache)
        if not self.session.wait([rid], timeout_s=300):
            raise TimeoutError(f"request {rid} did not finish within 300 s")
        result = self.session.result(rid)
        if result.error:
            raise RuntimeError(f"request {rid} failed: {result.error}")
        return result

    def close(self) -> None:
        self.session.close()


class EngineTtft:
    """Engine-side TTFT (queue + prefill) of the requests between two reads of the engine counters.

    Beside the client's TTFT it tells whether a slow request was slow inside the engine or around
    it (text steps, ensemble, gRPC).
    """

    def __init__(self, metrics_url: str):
        self.metrics_url = metrics_url
        self.last = self._read()

    def _read(self) -> tuple[float, float]:
        metrics = scrape_metrics(self.metrics_url)
        return (
            metric_total(metrics, "llm_engine_ttft_seconds_sum"),
            metric_total(metrics, "llm_engine_ttft_seconds_count"),
        )

    def mean_ms_since_last(self) -> float:
        now = self._read()
        total, count = now[0] - self.last[0], now[1] - self.last[1]
        self.last = now
        return total / count * 1000.0 if count else float("nan")


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def percentile(values: list[float], q: int) -> float:
    """The `q`-th percentile (1..99), interpolated between the two nearest values as numpy's default:
    indexing the sorted values at `q * n // 100` read the maximum as P75 of 4 values and as P90 of 10."""
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def quartiles(values: list[float]) -> tuple[float, float]:
    return percentile(values, 25), percentile(values, 75)


def machine_description() -> str:
    try:
        gpu = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        gpu = ""
    cpu = platform.processor() or platform.machine()
    return f"{platform.node()} ({cpu}, {gpu or 'no GPU'})"


def print_table(headers: list[str], rows: list[list[object]]) -> str:
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]  # no rows: headers
    lines = [
        "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |",
        "|" + "|".join("-" * (w + 2) for w in widths) + "|",
    ]
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in cells]
    table = "\n".join(lines)
    print(table, flush=True)
    return table


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def write_results(
    name: str,
    tag: str,
    payload: dict,
    table: str,
    command: str,
    results_dir: Path | None = None,
    machine: str | None = None,
) -> Path:
    """<results_dir>/<name>-<tag>.json and .md (command, machine, date beside the figures).

    `machine`: where the figures were measured when that is not here (a report rebuilt from saved runs).
    """
    results_dir = results_dir or RESULTS
    results_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    meta = {"command": command, "machine": machine or machine_description(), "date": stamp}
    data = {**meta, **{k: (asdict(v) if is_dataclass(v) else v) for k, v in payload.items()}}
    base = results_dir / f"{name}-{tag}"
    base.with_suffix(".json").write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")
    md = (
        f"# {name} ({tag})\n\n- command: `{command}`\n- machine: {meta['machine']}\n"
        f"- date: {stamp}\n\n{table}\n"
    )
    base.with_suffix(".md").write_text(md, encoding="utf-8")
    return base


def link_plot(base: Path) -> None:
    """Show <base>.png at the end of <base>.md (the figures beside their table)."""
    md = base.with_suffix(".md")
    md.write_text(md.read_text() + f"\n![plot]({base.name}.png)\n")
    progress(f"wrote {base}.json/.md/.png")


def progress(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


def plot_ttft_by_index(
    series: dict[str, list[float]],
    path: Path,
    title: str,
    *,
    style: str = ".",
    divider: tuple[int, str] | None = None,
) -> None:
    """TTFT against request index, one line per configuration (log scale); `divider` marks a phase change."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.8))
    for name, ttft in series.items():
        ax.plot(range(len(ttft)), ttft, style, markersize=3, linewidth=0.6, alpha=0.8, label=name)
    if divider is not None:
        ax.axvline(divider[0], color="grey", linestyle=":", label=divider[1])
    ax.set_yscale("log")
    ax.set_xlabel("request index after READY")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def start_stack(options: launch.StackOptions) -> launch.Stack:
    """`deploy.launch.start_stack`, once this process has a tenant secret its stacks inherit: the
    benchmarks' clients name tenants, and a stack that made a secret of its own would refuse them."""
    share_tenant_secret()
    return launch.start_stack(options)
