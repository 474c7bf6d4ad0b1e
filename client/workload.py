"""A request mix for load tests: SLO tiers, skewed tenants, heavy-tailed prompt and output lengths.

Why these shapes: a scheduler is only tested by traffic that looks like production's: a few tenants
send most requests (Zipf), most prompts are short but a long tail is very long (lognormal, capped at
what the deployment accepts), and tiers arrive mixed. Tier counts are exact quotas (largest remainder,
then shuffled) rather than independent draws, so a short run of 20 requests still has the mix asked for
and two policies compared on one seed see the same requests.

The same plan can be replayed by `client.load.run_load` (open loop, client-side TTFT) or exported with
`export_perf_analyzer_json` as perf_analyzer's ``--input-data`` for the `llm` ensemble.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from deploy.stack_secret import write_owner_only
from scheduler.tenant_auth import TOOL_TOKEN_TTL_S, token_from_env

DEFAULT_MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "tiny-llama"
DEFAULT_MIX: dict[str, float] = {"critical": 0.1, "warmup": 0.05, "standard": 0.55, "batch": 0.3}


@dataclass(frozen=True)
class PlannedRequest:
    """One request of a plan: due `at_s` seconds after the run starts."""

    at_s: float
    tier: str
    tenant: str
    prompt: str
    max_tokens: int
    prompt_tokens: int = 0  # the length asked for; the prompt's real count may differ by a token or two
    cache: str | None = None  # the request's `cache` mode (None: the server's default, `use`)

    def sampling(self) -> dict[str, Any]:
        """sampling_parameters: ignore_eos so the output length is the one planned, not the model's EOS."""
        return {"max_tokens": self.max_tokens, "ignore_eos": True}


@dataclass(frozen=True)
class TierMix:
    """Tier name -> weight; weights are normalized, so 2:5:3 and 0.2:0.5:0.3 are the same mix."""

    weights: Mapping[str, float]

    def __post_init__(self) -> None:
        if not self.weights:
            raise ValueError("a tier mix needs at least one tier")
        bad = {k: v for k, v in self.weights.items() if not (v >= 0 and math.isfinite(v))}
        total = sum(self.weights.values())
        if bad or not 0 < total < math.inf:  # 1e308 twice sums to infinity: every fraction 0
            raise ValueError(f"tier weights must be finite, >= 0 and not all 0; got {dict(self.weights)}")

    @classmethod
    def parse(cls, text: str) -> TierMix:
        """'critical=0.2,standard=0.5,batch=0.3' (the CLI's --mix)."""
        weights: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, sep, value = part.partition("=")
            if not sep or not name.strip():
                raise ValueError(f"bad mix entry {part!r}; expected tier=fraction, e.g. critical=0.2")
            try:
                weights[name.strip()] = float(value)
            except ValueError:
                raise ValueError(f"bad fraction in mix entry {part!r}; expected a number") from None
        return cls(weights)

    @property
    def fractions(self) -> dict[str, float]:
        total = sum(self.weights.values())
        return {name: w / total for name, w in self.weights.items()}

    def assign(self, n: int, rng: np.random.Generator) -> list[str]:
        """n tier names with exact quotas (largest remainder), in a random order."""
        names = list(self.fractions)
        exact = np.array([self.fractions[t] * n for t in names])
        counts = np.floor(exact).astype(int)
        order = np.argsort(-(exact - counts), kind="stable")
        counts[order[: n - int(counts.sum())]] += 1
        tiers = np.repeat(np.array(names, dtype=object), counts)
        return [str(t) for t in rng.permutation(tiers)]


@dataclass(frozen=True)
class TenantSkew:
    """`count` tenants whose request shares follow Zipf's law: tenant i (from 0) gets (i+1)^-s."""

    count: int = 8
    exponent: float = 1.1
    prefix: str = "tenant-"

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError(f"tenant count must be >= 1, got {self.count}")
        if not (self.exponent >= 0 and math.isfinite(self.exponent)):
            raise ValueError(f"zipf exponent must be finite and >= 0, got {self.exponent}")

    @property
    def names(self) -> list[str]:
        width = len(str(self.count - 1))
        return [f"{self.prefix}{i:0{width}d}" for i in range(self.count)]

    @property
    def probabilities(self) -> np.ndarray:
        p = np.arange(1, self.count + 1, dtype=np.float64) ** -self.exponent
        return p / p.sum()

    def assign(self, n: int, rng: np.random.Generator) -> list[str]:
        names = self.names
        return [names[i] for i in rng.choice(self.count, size=n, p=self.probabilities)]


@dataclass(frozen=True)
class LengthDistribution:
    """Lognormal token lengths around `median` (sigma = log-space spread), clipped to [minimum, maximum].

    sigma 1 puts P99 at ~10x the median: the long tail that makes prefill time vary by orders of
    magnitude; the cap is what the deployment accepts (max prompt tokens, max_tokens).
    """

    median: float
    sigma: float
    minimum: int = 1
    maximum: int = 1024

    def __post_init__(self) -> None:
        if not (self.median > 0 and self.sigma >= 0):
            raise ValueError(f"need median > 0 and sigma >= 0, got median={self.median}, sigma={self.sigma}")
        if not 1 <= self.minimum <= self.maximum:
            raise ValueError(f"need 1 <= minimum <= maximum, got {self.minimum}, {self.maximum}")

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        raw = rng.lognormal(math.log(self.median), self.sigma, size=n)
        return np.clip(np.rint(raw), self.minimum, self.maximum).astype(np.int64)


class PromptSource(Protocol):
    """Prompt texts of about the given token lengths; the same rng state gives the same texts."""

    def texts(self, lengths: Sequence[int], rng: np.random.Generator) -> list[str]: ...


class CorpusPrompts:
    """Distinct prompts cut from data/corpus.txt with the served model's tokenizer (bench's PromptFactory).

    Each plan starts at an rng-chosen corpus offset and walks on, so prompts within a plan differ (no
    accidental prefix-cache hits) while one seed always yields the same texts.
    """

    def __init__(self, model_dir: Path = DEFAULT_MODEL_DIR) -> None:
        from bench.common import PromptFactory  # tokenizers: imported only when corpus prompts are used

        if not (Path(model_dir) / "tokenizer.json").exists():
            raise FileNotFoundError(
                f"{model_dir}/tokenizer.json not found; pass --model-dir with the served model's tokenizer "
                "(make setup builds models/tiny-llama)"
            )
        self._factory = PromptFactory(Path(model_dir))

    def texts(self, lengths: Sequence[int], rng: np.random.Generator) -> list[str]:
        self._factory.cursor = int(rng.integers(len(self._factory.ids)))
        return [self._factory.make(int(n)) for n in lengths]

    def count(self, text: str) -> int:
        """Tokens in `text` as the server's tokenizer counts them (BOS included)."""
        return self._factory.count(text)


@dataclass(frozen=True)
class Workload:
    """Everything that decides *what* is sent; *when* comes from an arrival schedule (client.arrivals)."""

    prompts: PromptSource
    mix: TierMix = field(default_factory=lambda: TierMix(DEFAULT_MIX))
    tenants: TenantSkew = field(default_factory=TenantSkew)
    prompt_lengths: LengthDistribution = field(
        default_factory=lambda: LengthDistribution(median=48, sigma=1.0, minimum=4, maximum=1024)
    )
    output_lengths: LengthDistribution = field(
        default_factory=lambda: LengthDistribution(median=12, sigma=0.8, minimum=1, maximum=128)
    )

    def generate(self, schedule: int | Sequence[float] | np.ndarray, seed: int = 0) -> list[PlannedRequest]:
        """A plan: one request per arrival time in `schedule`, or `schedule` requests all due at 0 when an
        int is given (e.g. for perf_analyzer input data, which has no timing). Independent rng streams
        per aspect, so changing e.g. the tenant count leaves tiers and lengths of a seed unchanged."""
        times = (
            np.zeros(int(schedule))
            if isinstance(schedule, (int, np.integer))
            else np.asarray(schedule, dtype=np.float64)
        )
        n = int(times.size)
        tier_rng, tenant_rng, prompt_rng, output_rng, text_rng = (
            np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(5)
        )
        tiers = self.mix.assign(n, tier_rng)
        tenants = self.tenants.assign(n, tenant_rng)
        prompt_tokens = self.prompt_lengths.sample(n, prompt_rng)
        max_tokens = self.output_lengths.sample(n, output_rng)
        texts = self.prompts.texts([int(x) for x in prompt_tokens], text_rng)
        return [
            PlannedRequest(float(times[i]), tiers[i], tenants[i], texts[i], int(max_tokens[i]),
                           int(prompt_tokens[i]))
            for i in range(n)
        ]  # fmt: skip


EXPORTED_TOKEN_TTL_S = 30 * 86400  # an exported input file is replayed for days, not one run


def perf_analyzer_entry(
    request: PlannedRequest, token_ttl_s: int | None = TOOL_TOKEN_TTL_S
) -> dict[str, Any]:
    """One --input-data entry for the `llm` ensemble: every input with its content and shape [1]."""

    def tensor(value: Any) -> dict[str, Any]:
        return {"content": [value], "shape": [1]}

    entry = {
        "text_input": tensor(request.prompt),
        "stream": tensor(True),
        "sampling_parameters": tensor(json.dumps(request.sampling())),
        "slo_tier": tensor(request.tier),
        "tenant": tensor(request.tenant),
    }
    if request.cache is not None:
        entry["cache"] = tensor(request.cache)
    if (token := token_from_env(request.tenant, ttl_s=token_ttl_s)) is not None:
        entry["tenant_token"] = tensor(token)
    return entry


def export_perf_analyzer_json(
    requests: Sequence[PlannedRequest], path: str | Path, token_ttl_s: int | None = EXPORTED_TOKEN_TTL_S
) -> Path:
    """Write perf_analyzer's --input-data JSON ({"data": [entry, ...]}); perf_analyzer sends the entries
    in order (its own pacing replaces `at_s`). BYTES inputs are plain strings, BOOL a JSON bool. Tenant
    tokens (with the secret in the environment) are signed for `token_ttl_s`: a file is replayed later."""
    if not requests:
        raise ValueError("no requests to export; perf_analyzer needs at least one input data entry")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # in arrival order, as export_request_intervals writes the gaps: perf_analyzer pairs entry i with gap i
    entries = [perf_analyzer_entry(r, token_ttl_s) for r in sorted(requests, key=lambda r: r.at_s)]
    text = json.dumps({"data": entries}, indent=1, ensure_ascii=False) + "\n"
    if any("tenant_token" in entry for entry in entries):  # tokens valid for days: for the owner's eyes only
        return write_owner_only(path, text)
    path.write_text(text, encoding="utf-8")
    return path


def export_request_intervals(requests: Sequence[PlannedRequest], path: str | Path) -> Path:
    """Write the plan's arrival gaps for perf_analyzer's --request-intervals (microseconds, one a line,
    at least 1): with the --input-data export, perf_analyzer replays the same arrivals open loop."""
    times = np.array(sorted(r.at_s for r in requests), dtype=np.float64)
    if times.size == 0:
        raise ValueError("no requests to export; perf_analyzer needs at least one interval")
    gaps_us = np.maximum(1, np.rint(np.diff(times, prepend=0.0) * 1e6)).astype(np.int64)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{g}\n" for g in gaps_us), encoding="utf-8")
    return path


@dataclass(frozen=True)
class ProfiledRequest:
    """One request from perf_analyzer's --profile-export-file, times in seconds. `experiment` is e.g.
    'concurrency=2'; tier and tenant come from the inputs perf_analyzer sent ('' when absent)."""

    experiment: str
    tier: str
    tenant: str
    ttft_s: float | None  # to the first non-empty piece, as client.load's; None when none came
    total_s: float
    responses: int
    output_pieces: int


def read_perf_analyzer_profile(path: str | Path) -> list[ProfiledRequest]:
    """TTFT and total time per request from perf_analyzer's --profile-export-file (all experiments).

    Why: for this decoupled ensemble perf_analyzer 2.50's printed "latency" is the whole request (first
    request to last response), not time to first token; its profile export keeps every response's
    timestamp (ns) and the inputs sent, so TTFT = first response with text - request timestamp, per
    tier, comparable with client.load's TTFT (send -> first non-empty piece): a first token that ends
    inside a UTF-8 character comes back as an empty piece, and the text waits for the next token.
    """
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    out = []
    for experiment in data["experiments"]:
        label = f"{experiment['experiment']['mode']}={experiment['experiment']['value']}"
        for r in experiment["requests"]:
            stamps = r["response_timestamps"]
            if not stamps:
                continue
            inputs = r.get("request_inputs", {})
            outputs = r.get("response_outputs", [])
            pieces = sum(1 for o in outputs if o.get("text_output"))
            if len(outputs) == len(stamps):  # one output per response: the first one with text
                texts = [stamp for stamp, o in zip(stamps, outputs) if o.get("text_output")]
                first = texts[0] if texts else None
            else:  # no outputs exported: the first response
                first = stamps[0]
            out.append(
                ProfiledRequest(
                    label,
                    str(inputs.get("slo_tier", "")),
                    str(inputs.get("tenant", "")),
                    None if first is None else (first - r["timestamp"]) / 1e9,
                    (stamps[-1] - r["timestamp"]) / 1e9,
                    len(stamps),
                    pieces,
                )  # fmt: skip
            )
    return out
