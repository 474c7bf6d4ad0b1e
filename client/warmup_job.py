"""The warmup job: pick the prompts worth having in cache before a traffic peak, then send them.

Offline (`select_warmup_set`, pure, no server): count identical prompts per tenant in a query log, embed
the distinct ones (all-MiniLM-L6-v2), cluster them, and keep the top `top_percent` by frequency plus the
`per_cluster` most frequent of every cluster, so a topic with many different but individually rare
prompts still gets its shared prefix warmed. Then add the templates of SLO-sensitive scenarios (they
must be warm whatever the log says) and, on request, synthetic edge cases that exercise shapes and code
paths real traffic hits rarely but pays dearly for cold (the longest prompt, a near-limit one, a very
short one, multi-byte text through the incremental detokenizer).

Online (`send_warmup_set`): send the selection at tier `warmup` over one gRPC stream, a few at a time
and with few new tokens, so the engine fills its prefix cache (L1) and the Redis KV tier (L3) while the
tier's precedence keeps it ahead of standard traffic without competing with critical requests.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import yaml
from tqdm import tqdm

from client.generate import StreamingSession
from scheduler.messages import utf8_encodable
from scheduler.tenant_auth import secret_error
from scheduler.tiers import WARMUP_TIER
from scheduler.validation import DEFAULT_TENANT, TENANT_PATTERN, TENANT_RULE

EmbedFn = Callable[[list[str]], np.ndarray]
TokenCounter = Callable[[str], int]

REASON_TOP = "top_frequency"
REASON_CLUSTER = "cluster_top"
REASON_TEMPLATE = "slo_template"
REASON_EDGE = "edge_case"
REASONS = (REASON_TOP, REASON_CLUSTER, REASON_TEMPLATE, REASON_EDGE)

SHORT_PROMPT = "Hi"
NON_ASCII_PROMPT = (
    "¿Dónde está mi pedido? 注文した商品はいつ届きますか？ Где мой заказ? Ça arrive quand ? 🚚📦"
)
FILLER = "The quick brown fox jumps over the lazy dog while the support team answers every question. "
MALFORMED_SHOWN = 5
EMBED_CHUNK = 512  # prompts embedded per call: the bar moves, and no call holds a huge batch
NEAR_LIMIT_CHARS_PER_TOKEN = 8  # text gathered for the near-limit prompt: more than any tokenizer packs


def utf8_token_bound(text: str) -> int:
    """Upper bound of a byte-level BPE token count (one token per byte at worst, plus BOS): used when no
    tokenizer is given, so a prompt judged to fit the server's limit always does."""
    return len(text.encode("utf-8")) + 1


def normalize_prompt(text: str) -> str:
    """Prompts that differ only in whitespace are the same request to a user and nearly the same prefix
    to the engine, so they are counted together."""
    return " ".join(text.split())


# --------------------------------------------------------------------------------------------- query log
@dataclass(frozen=True)
class LogRecord:
    prompt: str
    tenant: str
    ts: str | None = None


@dataclass(frozen=True)
class MalformedLine:
    line_no: int
    reason: str


@dataclass(frozen=True)
class QueryLog:
    """A parsed log, counted as it was read (memory grows with its distinct prompts, not its lines: a
    day of production traffic is millions of lines); malformed lines are kept as (line, reason) so the
    job can say what it skipped."""

    stats: tuple[PromptStats, ...]  # distinct (tenant, prompt), most frequent first
    records: int
    malformed: tuple[MalformedLine, ...]
    total_lines: int

    def describe_malformed(self, source: str, shown: int = MALFORMED_SHOWN) -> list[str]:
        lines = [f"{source}:{m.line_no}: skipped: {m.reason}" for m in self.malformed[:shown]]
        if len(self.malformed) > shown:
            lines.append(f"... and {len(self.malformed) - shown} more malformed lines")
        if self.malformed:
            lines.append(
                f"skipped {len(self.malformed)} malformed of {self.total_lines} non-empty lines in {source}"
            )
        return lines


def _parse_line(text: str, tenant_field: str) -> LogRecord | str:
    """A record, or why the line cannot be one."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        return f"not valid JSON: {exc.msg} (column {exc.colno})"
    except RecursionError:
        return "not valid JSON: nested too deep"
    except ValueError as exc:  # an integer past int's digit limit (a corrupted "ts") is not a JSONDecodeError
        return f"not valid JSON: {exc}"[:120]
    if not isinstance(obj, dict):
        return f"expected a JSON object, got {type(obj).__name__}"
    prompt = obj.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        return f"'prompt' must be a non-empty string, got {prompt!r:.40}"
    if not utf8_encodable(prompt):  # half of an emoji's surrogate pair, as a logger cutting UTF-16 writes it
        return "'prompt' is not valid UTF-8 (a lone surrogate escape)"
    tenant = obj.get(tenant_field)
    if tenant is None or tenant == "":
        tenant = DEFAULT_TENANT
    if not isinstance(tenant, str) or not TENANT_PATTERN.fullmatch(tenant):
        return f"{tenant_field!r} must be {TENANT_RULE}, got {tenant!r:.40}"
    ts = obj.get("ts")
    return LogRecord(prompt, tenant, None if ts is None else str(ts))


def parse_query_log(lines: Iterable[str | bytes], tenant_field: str = "tenant") -> QueryLog:
    """JSONL lines ({"prompt", tenant_field, "ts"}) -> counted prompts; blank lines are ignored, a line
    that is not a usable record is counted with its reason, never fatal: one bad write must not cancel
    warmup. Lines given as bytes must be UTF-8: a prompt a logger cut inside a character is no prompt any
    client sends, so it is skipped rather than warmed with a replacement character."""
    counts = PromptCounter()
    malformed: list[MalformedLine] = []
    total = 0
    for line_no, raw in enumerate(lines, start=1):
        if line_no == 1:  # a byte order mark (Windows tools write one) is no part of the first record
            raw = raw.removeprefix(b"\xef\xbb\xbf" if isinstance(raw, bytes) else "\ufeff")
        if not raw.strip():
            continue
        total += 1
        try:
            line = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        except UnicodeDecodeError as exc:
            malformed.append(MalformedLine(line_no, f"not valid UTF-8 (byte {exc.start})"))
            continue
        parsed = _parse_line(line, tenant_field)
        if isinstance(parsed, LogRecord):
            counts.add(parsed)
        else:
            malformed.append(MalformedLine(line_no, parsed))
    return QueryLog(tuple(counts.stats()), counts.records, tuple(malformed), total)


def read_query_log(path: Path, tenant_field: str = "tenant") -> QueryLog:
    with path.open("rb") as fh:
        return parse_query_log(fh, tenant_field)


# ----------------------------------------------------------------------------------------------- templates
@dataclass(frozen=True)
class SloTemplate:
    scenario: str
    tenant: str
    prompt: str


TEMPLATE_KEYS = ("scenario", "tenant", "prompt")


def parse_templates(data: object, source: str = "templates") -> list[SloTemplate]:
    """The YAML's `scenarios` list; unlike the log, a bad template is an error: it is hand-written
    configuration, and silently skipping an SLO-critical scenario would leave it cold."""
    if data is None:
        return []
    if not isinstance(data, dict) or not isinstance(data.get("scenarios"), list):
        raise ValueError(f"{source}: expected a mapping with a 'scenarios' list")
    out: list[SloTemplate] = []
    for i, entry in enumerate(data["scenarios"]):
        where = f"{source}: scenarios[{i}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: expected a mapping with scenario, tenant, prompt")
        unknown = [key for key in entry if key not in TEMPLATE_KEYS]
        if unknown:  # a misspelled `tenant:` would warm tenant 'default' and leave the scenario's cold
            raise ValueError(
                f"{where}: unknown key {', '.join(repr(k) for k in unknown)}; "
                f"allowed: {', '.join(TEMPLATE_KEYS)}"
            )
        scenario, tenant, prompt = (
            entry.get("scenario"),
            entry.get("tenant", DEFAULT_TENANT),
            entry.get("prompt"),
        )
        if not isinstance(scenario, str) or not scenario.strip():
            raise ValueError(f"{where}: 'scenario' must be a non-empty string")
        if not isinstance(tenant, str) or not TENANT_PATTERN.fullmatch(tenant):
            raise ValueError(f"{where}: 'tenant' must be {TENANT_RULE}, got {tenant!r}")
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(f"{where}: 'prompt' must be a non-empty string")
        if not utf8_encodable(prompt):  # "\ud83d" in a double-quoted YAML string: half an emoji
            raise ValueError(f"{where}: 'prompt' is not valid UTF-8 (a lone surrogate escape)")
        out.append(SloTemplate(scenario.strip(), tenant, prompt))
    return out


MERGE_TAG = "tag:yaml.org,2002:merge"


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load, but a key given twice in one mapping is an error: YAML keeps the last, so a second
    `scenarios:` list would silently drop the first one's templates."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set[object] = set()
        for key_node, _ in node.value:
            if key_node.tag == MERGE_TAG:  # `<<: *anchor`: its keys may be overridden, as in safe_load
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                hash(key)
            except TypeError:
                raise yaml.constructor.ConstructorError(
                    None, None, f"found unhashable key {key!r:.40}", key_node.start_mark
                ) from None
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_templates(path: Path) -> list[SloTemplate]:
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
    except RecursionError:
        raise ValueError(f"{path}: nested too deep") from None
    return parse_templates(data, str(path))


# ----------------------------------------------------------------------------------------------- selection
@dataclass(frozen=True)
class WarmupItem:
    """One request to send. `frequency` is its count in the log (0 for templates and synthetic cases);
    `cluster` its topic cluster (None when it is not from the log); `detail` the scenario or edge case."""

    prompt: str
    tenant: str
    reason: str
    frequency: int
    cluster: int | None
    detail: str = ""


@dataclass(frozen=True)
class SelectionConfig:
    top_percent: float = 5.0
    per_cluster: int = 2
    clusters: int | None = None  # None: chosen from the data (silhouette)
    edge_cases: bool = True  # the selection adds them; the CLI's --no-edge-cases leaves them out
    max_prompt_tokens: int = 2047  # the server's limit (max_seq_len - 1)
    near_limit_fraction: float = 0.9
    max_auto_clusters: int = 12
    seed: int = 0
    # a day's log can hold a million distinct prompts: its top 5% alone would be 50,000 requests, and
    # embedding them all hours of CPU. Log-derived items (top and per-cluster) are capped, the cluster
    # picks kept first (they are the topic coverage), and only the most frequent prompts are clustered.
    max_items: int | None = 1000  # None: no cap
    max_embedded: int = 20000

    def __post_init__(self) -> None:
        if self.max_items is not None and self.max_items < 0:
            raise ValueError(f"max_items must be >= 0 or None (no cap), got {self.max_items}")
        if self.max_embedded < 1:
            raise ValueError(f"max_embedded must be >= 1, got {self.max_embedded}")
        if not 0.0 <= self.top_percent <= 100.0:
            raise ValueError(f"top_percent must be in [0, 100], got {self.top_percent}")
        if self.per_cluster < 0:
            raise ValueError(f"per_cluster must be >= 0, got {self.per_cluster}")
        if self.clusters is not None and self.clusters < 1:
            raise ValueError(f"clusters must be >= 1 or None (auto), got {self.clusters}")
        if self.max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}")
        if not 0.0 < self.near_limit_fraction <= 1.0:
            raise ValueError(f"near_limit_fraction must be in (0, 1], got {self.near_limit_fraction}")


@dataclass(frozen=True)
class PromptStats:
    """A distinct (tenant, normalized prompt): `text` is its most frequent raw form (that is what real
    requests send, so that is the prefix worth caching), `first_seen` breaks frequency ties stably."""

    tenant: str
    key: str
    text: str
    frequency: int
    first_seen: int


class PromptCounter:
    """Distinct (tenant, normalized prompt) counted one record at a time, with each one's raw forms."""

    def __init__(self) -> None:
        self._variants: dict[tuple[str, str], Counter[str]] = {}
        self._first: dict[tuple[str, str], int] = {}
        self.records = 0

    def add(self, record: LogRecord) -> None:
        key = _item_key(record)
        self._variants.setdefault(key, Counter())[record.prompt] += 1
        self._first.setdefault(key, self.records)
        self.records += 1

    def stats(self) -> list[PromptStats]:
        """Most frequent first (ties: first seen in the log first)."""
        stats = [
            PromptStats(
                tenant, norm, forms.most_common(1)[0][0], sum(forms.values()), self._first[(tenant, norm)]
            )
            for (tenant, norm), forms in self._variants.items()
        ]
        return sorted(stats, key=lambda s: (-s.frequency, s.first_seen))


def count_prompts(records: Iterable[LogRecord]) -> list[PromptStats]:
    """Distinct prompts per tenant, most frequent first (ties: first seen in the log first)."""
    counter = PromptCounter()
    for record in records:
        counter.add(record)
    return counter.stats()


SILHOUETTE_SAMPLE = 3000  # points a k is scored on: silhouette is quadratic in them


def choose_k(embeddings: np.ndarray, max_k: int, seed: int) -> int:
    """k with the best silhouette among 2..max_k: topics in a query log are few and well separated in
    MiniLM space, and silhouette needs no guess of their number. Fewer than 4 points: one cluster."""
    from sklearn.metrics import silhouette_score

    n = len(embeddings)
    if n < 4:
        return 1
    best_k, best_score = 1, -1.0
    sample = np.random.RandomState(seed).permutation(n)[:SILHOUETTE_SAMPLE]  # sklearn's own sample_size draw
    for k in range(2, min(max_k, n - 1) + 1):
        labels = _kmeans(embeddings, k, seed)[sample]
        if len(set(labels.tolist())) < 2:  # the sample missed every cluster but one (an outlier alone, say)
            continue
        score = float(silhouette_score(embeddings[sample], labels))
        if score > best_score + 1e-9:
            best_k, best_score = k, score
    return best_k


def _kmeans(embeddings: np.ndarray, k: int, seed: int) -> np.ndarray:
    """KMeans up to a few thousand distinct prompts; MiniBatchKMeans beyond, where full passes get slow."""
    from sklearn.cluster import KMeans, MiniBatchKMeans

    if k <= 1:
        return np.zeros(len(embeddings), dtype=np.int64)
    if len(embeddings) > 5000:
        model = MiniBatchKMeans(n_clusters=k, random_state=seed, n_init=3, batch_size=1024)
    else:
        model = KMeans(n_clusters=k, random_state=seed, n_init=4)
    return model.fit_predict(embeddings)


def cluster_prompts(
    texts: list[str], embed: EmbedFn, config: SelectionConfig, progress: TextIO | None = None
) -> dict[str, int]:
    """normalized text -> cluster id; texts are clustered once across tenants (topics are shared),
    cluster ids renumbered by first appearance so they are stable for a given log. `progress`: where a
    bar of the embedding goes (minutes of CPU for a big log), None for none."""
    if not texts:
        return {}
    with tqdm(
        total=len(texts), desc="embedding", unit="prompt", file=progress, disable=progress is None
    ) as bar:
        parts = []
        for start in range(0, len(texts), EMBED_CHUNK):
            parts.append(np.asarray(embed(texts[start : start + EMBED_CHUNK]), dtype=np.float32))
            bar.update(len(parts[-1]))
    embeddings = np.concatenate(parts)
    k = config.clusters if config.clusters is not None else choose_k(embeddings, config.max_auto_clusters,
                                                                     config.seed)  # fmt: skip
    labels = _kmeans(embeddings, min(k, len(texts)), config.seed)
    renumber: dict[int, int] = {}
    for label in labels.tolist():
        renumber.setdefault(label, len(renumber))
    return {text: renumber[label] for text, label in zip(texts, labels.tolist())}


def near_limit_prompt(source_texts: Sequence[str], target_tokens: int, count_tokens: TokenCounter) -> str:
    """The longest prefix of the log's own text (cycled) with at most `target_tokens` tokens: realistic
    text of the length that the largest prefill bucket and KV allocation have to handle."""
    base = " ".join(source_texts) or FILLER
    text = base
    while count_tokens(text) < target_tokens and len(text) < 64 * max(target_tokens, 1):
        text += " " + base
    lo, hi = 1, len(text)
    while lo < hi:  # the largest length whose prefix fits
        mid = (lo + hi + 1) // 2
        if count_tokens(text[:mid]) <= target_tokens:
            lo = mid
        else:
            hi = mid - 1
    return text[:lo].rstrip() or SHORT_PROMPT


def _edge_cases(
    stats: Sequence[PromptStats],
    clusters: dict[str, int],
    config: SelectionConfig,
    count_tokens: TokenCounter,
) -> list[WarmupItem]:
    tenant_load: Counter[str] = Counter()
    for s in stats:
        tenant_load[s.tenant] += s.frequency
    busiest = tenant_load.most_common(1)[0][0] if tenant_load else DEFAULT_TENANT
    items = []
    if stats:
        longest = max(stats, key=lambda s: (count_tokens(s.text), len(s.text), -s.first_seen))
        items.append(WarmupItem(longest.text, longest.tenant, REASON_EDGE, longest.frequency,
                                clusters.get(longest.key), "longest_seen"))  # fmt: skip
    target = max(1, int(config.max_prompt_tokens * config.near_limit_fraction))
    source, chars = [], 0
    for s in stats:  # the busiest tenant's most frequent prompts, enough text: never another tenant's
        if s.tenant != busiest:
            continue
        if chars > NEAR_LIMIT_CHARS_PER_TOKEN * target:
            break
        source.append(s.text.strip())
        chars += len(source[-1]) + 1
    near = near_limit_prompt(source, target, count_tokens)
    items.append(WarmupItem(near, busiest, REASON_EDGE, 0, None, "near_limit"))
    items.append(WarmupItem(SHORT_PROMPT, busiest, REASON_EDGE, 0, None, "very_short"))
    items.append(WarmupItem(NON_ASCII_PROMPT, busiest, REASON_EDGE, 0, None, "non_ascii"))
    return items


def _item_key(item: LogRecord | WarmupItem) -> tuple[str, str]:
    """What makes two records or items the same request: tenant and prompt, whitespace aside."""
    return item.tenant, normalize_prompt(item.prompt)


@dataclass(frozen=True)
class Selection:
    items: list[WarmupItem]  # in send order
    capped: int  # log-derived items left out by `max_items`
    too_long: int  # distinct log prompts over `max_prompt_tokens`, which the server would reject
    clustered: int  # distinct prompts embedded and clustered (at most `max_embedded`)
    clusterable: int  # distinct prompt texts (any tenant) within the limit: `clustered` of them were


def select_warmup_set(
    records: Iterable[LogRecord], templates: Sequence[SloTemplate], **options: Any
) -> list[WarmupItem]:
    """`select_from_counts` over log records, keyword options as there: the items only."""
    return select_from_counts(count_prompts(records), templates, **options).items


def select_from_counts(
    counted: Sequence[PromptStats],
    templates: Sequence[SloTemplate],
    *,
    embed: EmbedFn,
    config: SelectionConfig | None = None,
    count_tokens: TokenCounter = utf8_token_bound,
    progress: TextIO | None = None,
) -> Selection:
    """The warmup selection, in send order: top `top_percent` of distinct (tenant, prompt) by frequency
    (at least one when the log has any), then the `per_cluster` most frequent of each cluster not
    already chosen, then the SLO templates, then (`edge_cases`, the default) the synthetic edge cases. An item
    appears once per (tenant, normalized prompt), under its first reason. Log prompts longer than
    `max_prompt_tokens` are left out: the server would reject them. Past `max_items` log-derived items,
    the least frequent top items go first, then the cluster picks of the last clusters; templates and
    edge cases always stay. Only the `max_embedded` most frequent prompts are clustered."""
    config = config or SelectionConfig()
    stats = [s for s in counted if count_tokens(s.text) <= config.max_prompt_tokens]
    texts = list(dict.fromkeys(s.key for s in stats))  # distinct prompt texts, any tenant's
    embedded = texts[: config.max_embedded]
    clusters = cluster_prompts(embedded, embed, config, progress)
    # exact: 2.2% of 1,500 is 33, and the float product 33.000000000000004 would round up to 34
    n_top = math.ceil(Fraction(str(config.top_percent)) * len(stats) / 100) if config.top_percent > 0 else 0
    top = [WarmupItem(s.text, s.tenant, REASON_TOP, s.frequency, clusters.get(s.key)) for s in stats[:n_top]]
    per_cluster: dict[int, list[PromptStats]] = {}
    for s in stats:  # already most frequent first
        if s.key in clusters:
            per_cluster.setdefault(clusters[s.key], []).append(s)
    picks = [
        WarmupItem(s.text, s.tenant, REASON_CLUSTER, s.frequency, cluster)
        for cluster in sorted(per_cluster)
        for s in per_cluster[cluster][: config.per_cluster]
    ]
    wanted = list(dict.fromkeys(_item_key(item) for item in (*top, *picks)))
    capped = 0
    if config.max_items is not None and len(wanted) > config.max_items:
        kept = set(list(dict.fromkeys(_item_key(item) for item in picks))[: config.max_items])
        kept.update([key for key in wanted if key not in kept][: config.max_items - len(kept)])
        capped = len(wanted) - len(kept)
        top = [item for item in top if _item_key(item) in kept]
        picks = [item for item in picks if _item_key(item) in kept]
    chosen: dict[tuple[str, str], WarmupItem] = {}
    extra = [WarmupItem(t.prompt, t.tenant, REASON_TEMPLATE, 0, None, t.scenario) for t in templates]
    if config.edge_cases:
        extra += _edge_cases(stats, clusters, config, count_tokens)
    for item in (*top, *picks, *extra):
        chosen.setdefault(_item_key(item), item)
    return Selection(list(chosen.values()), capped, len(counted) - len(stats), len(embedded), len(texts))


# ------------------------------------------------------------------------------------------------- sending
@dataclass(frozen=True)
class SendConfig:
    url: str
    model: str = "llm"
    concurrency: int = 4
    max_tokens: int = 4
    timeout_s: float = 600.0
    progress: bool = True
    # True: greedy requests with cache=refresh, which never read the response caches (a read would answer
    # a repeat run, or a new replica sharing Redis, from Redis, and nothing would be prefilled) but keep
    # every answer there. The entries serve clients that ask greedily for up to `max_tokens` tokens (any
    # number when the answer ended within them). False: unseeded sampling, which no response cache keeps.
    fill_response_cache: bool = True

    def __post_init__(self) -> None:
        """Checked when the options are read, so a dry run (how an operator checks a CronJob's arguments)
        refuses what the real run would fail on."""
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {self.timeout_s}")
        if not (utf8_encodable(self.url or "") and utf8_encodable(self.model or "")):  # gRPC encodes them
            raise ValueError("url and model must be UTF-8 text")

    def sampling(self) -> dict[str, object]:
        return {"max_tokens": self.max_tokens, "temperature": 0.0 if self.fill_response_cache else 1.0}

    @property
    def cache_mode(self) -> str | None:
        """The requests' `cache`: see `fill_response_cache` (None: the server's default, `use`)."""
        return "refresh" if self.fill_response_cache else None


@dataclass(frozen=True)
class WarmupOutcome:
    item: WarmupItem
    sent: bool
    ttft_s: float | None
    error: str | None

    @property
    def ok(self) -> bool:
        return self.sent and self.error is None


def send_warmup_set(items: Sequence[WarmupItem], config: SendConfig, err: TextIO) -> list[WarmupOutcome]:
    """Send every item at tier warmup on one gRPC stream, at most `concurrency` in flight, with few new
    tokens: the point is the prefill (the KV blocks), not the text (see SendConfig.fill_response_cache
    for the sampling). Items left when `timeout_s` ran out are cancelled or not sent, and count as
    failed."""
    sampling = config.sampling()
    deadline = time.monotonic() + config.timeout_s
    by_id: dict[str, WarmupItem] = {}
    unsent: list[WarmupItem] = []
    with (
        StreamingSession(config.url, model=config.model) as session,
        tqdm(total=len(items), desc="warmup", unit="req", file=err, disable=not config.progress) as bar,
    ):
        in_flight: list[str] = []
        for index, item in enumerate(items):
            while len(in_flight) >= config.concurrency and in_flight:
                in_flight = _wait_any(session, in_flight, deadline, bar)
            if time.monotonic() >= deadline:
                unsent = list(items[index:])
                break
            rid = session.submit(item.prompt, sampling=sampling, tier=WARMUP_TIER, tenant=item.tenant,
                                 cache=config.cache_mode, exclude_input_in_output=True)  # fmt: skip
            by_id[rid] = item
            in_flight.append(rid)
        while in_flight:
            in_flight = _wait_any(session, in_flight, deadline, bar)
        results = session.results()
    outcomes = [WarmupOutcome(by_id[rid], True, r.ttft_s, r.error) for rid, r in results.items()]
    outcomes += [WarmupOutcome(item, False, None, "not sent: the job's timeout ran out") for item in unsent]
    return outcomes


def _wait_any(session: StreamingSession, in_flight: list[str], deadline: float, bar: tqdm) -> list[str]:
    """Block until at least one in-flight request finished (polling: StreamingSession.wait waits for
    all of a set); past the deadline, cancel the stream, which fails whatever is left."""
    while True:
        unfinished = set(session.unfinished())
        still = [rid for rid in in_flight if rid in unfinished]
        if len(still) < len(in_flight):
            bar.update(len(in_flight) - len(still))
            return still
        if time.monotonic() >= deadline:
            session.cancel()
            bar.update(len(in_flight))
            return []
        session.wait([in_flight[0]], timeout_s=0.02)


# ------------------------------------------------------------------------------------------------ reports
def _percentile_ms(values: list[float], q: float) -> str:
    return "n/a" if not values else f"{float(np.percentile(values, q)) * 1000:.1f}"


def summary_rows(outcomes: Sequence[WarmupOutcome]) -> list[list[object]]:
    """Per reason and in total: items, sent, failed, TTFT P50/P95 (ms) of the successful requests."""
    rows: list[list[object]] = []
    for reason in (*REASONS, "all"):
        group = [o for o in outcomes if reason in ("all", o.item.reason)]
        if not group and reason != "all":
            continue
        ttfts = [o.ttft_s for o in group if o.ok and o.ttft_s is not None]
        rows.append([reason, len(group), sum(o.sent for o in group), sum(not o.ok for o in group),
                     _percentile_ms(ttfts, 50), _percentile_ms(ttfts, 95)])  # fmt: skip
    return rows


def selection_rows(items: Sequence[WarmupItem]) -> list[list[object]]:
    def short(text: str, width: int = 60) -> str:
        flat = text.replace("\n", "\\n")
        return flat if len(flat) <= width else flat[: width - 3] + "..."

    return [
        [
            i,
            item.reason,
            item.detail,
            item.tenant,
            item.frequency,
            "" if item.cluster is None else item.cluster,
            len(item.prompt),
            short(item.prompt),
        ]  # fmt: skip
        for i, item in enumerate(items, start=1)
    ]


def _table(headers: list[str], rows: list[list[object]], out: TextIO) -> None:
    from bench.common import print_table

    with contextlib.redirect_stdout(out):
        print_table(headers, rows)


# ---------------------------------------------------------------------------------------------- whole job
@dataclass(frozen=True)
class JobOptions:
    log: Path
    templates: Path | None
    selection: SelectionConfig
    send: SendConfig
    tenant_field: str = "tenant"
    tokenizer: Path | None = None
    dry_run: bool = False
    metrics_url: str | None = None  # where the job reads the cache tiers once it has sent its requests


def token_counter(tokenizer: Path | None) -> TokenCounter:
    """The served model's tokenizer (tokenizer.json) when given: exact counts, like the server's check;
    otherwise the byte bound, which never lets an over-limit prompt through but underfills near_limit."""
    if tokenizer is None:
        return utf8_token_bound
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(tokenizer))
    except Exception as exc:  # the tokenizers library raises a bare Exception for a file it cannot read
        raise ValueError(f"cannot read tokenizer {tokenizer}: {exc}") from exc
    # as the server reads prompts by default (prompt_special_tokens=text): "</s>" typed in a prompt is its
    # characters, several tokens, not the one special token; in "parse" mode the server counts no more
    tok.encode_special_tokens = True
    return lambda text: len(tok.encode(text).ids)


def check_template_lengths(
    templates: list[SloTemplate], count_tokens: Callable[[str], int], options: JobOptions, err: TextIO
) -> int | None:
    """2 when a template is over the prompt limit by the exact tokenizer: the server would refuse it, and
    the dry run that checks a CronJob must say so. Without `--tokenizer` the count is a byte estimate that
    over-counts, so it only warns."""
    limit = options.selection.max_prompt_tokens
    exact = options.tokenizer is not None
    too_long = [(t, n) for t in templates if (n := count_tokens(t.prompt)) > limit]
    for template, n in too_long:
        level, unit = ("error", "tokens") if exact else ("warning", "tokens at most (no --tokenizer)")
        print(
            f"{level}: template {template.scenario!r} has {n} {unit}, over --max-prompt-tokens {limit}",
            file=err,
        )
    return 2 if too_long and exact else None


def run_job(options: JobOptions, out: TextIO, err: TextIO, *, embed: EmbedFn | None = None) -> int:
    """Select, print, and (unless dry run) send; 0 when every request succeeded, 1 when any failed,
    2 when the inputs cannot be read or the log holds lines but no usable record."""
    if (problem := secret_error()) is not None:  # every request's token is signed with the secret
        print(f"error: {problem}", file=err)
        return 2
    try:
        log = read_query_log(options.log, options.tenant_field)
        templates = load_templates(options.templates) if options.templates else []
        count_tokens = token_counter(options.tokenizer)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        print(f"error: {exc}", file=err)
        return 2
    if (status := check_template_lengths(templates, count_tokens, options, err)) is not None:
        return status
    for line in log.describe_malformed(str(options.log)):
        print(line, file=err)
    if log.total_lines and not log.records:  # a log shipper changed format: the peak would meet cold caches
        print(f"error: none of the {log.total_lines} lines of {options.log} is a usable record", file=err)
        return 2
    if embed is None:
        from cache.embedder import MiniLMEmbedder

        embed = MiniLMEmbedder().embed
    bar_to = err if options.send.progress else None
    selection = select_from_counts(log.stats, templates, embed=embed, config=options.selection,
                                   count_tokens=count_tokens, progress=bar_to)  # fmt: skip
    items, limits = selection.items, options.selection
    if selection.too_long:
        print(f"left out {selection.too_long} distinct log prompts over {limits.max_prompt_tokens} tokens",
              file=err)  # fmt: skip
    if selection.capped:
        print(f"left out {selection.capped} log prompts past --max-items {limits.max_items} "
              "(the least frequent top items first)", file=err)  # fmt: skip
    clustered = (
        ""
        if selection.clustered >= selection.clusterable
        else f", the {selection.clustered} most frequent clustered"
    )
    print(f"{log.records} records, {len(log.stats)} distinct prompts{clustered}; "
          f"selected {len(items)} warmup items", file=out)  # fmt: skip
    if options.dry_run:
        _table(
            ["#", "reason", "detail", "tenant", "freq", "cluster", "chars", "prompt"],
            selection_rows(items),
            out,
        )
        print("dry run: nothing sent", file=out)
        return 0
    outcomes = send_warmup_set(items, options.send, err)
    _table(["reason", "items", "sent", "failed", "TTFT P50 ms", "TTFT P95 ms"], summary_rows(outcomes), out)
    failed = [o for o in outcomes if not o.ok]
    for o in failed[:MALFORMED_SHOWN]:
        what = f"{o.item.reason}:{o.item.detail}" if o.item.detail else o.item.reason
        print(f"failed: {what} tenant={o.item.tenant}: {o.error}", file=err)
    if len(failed) > MALFORMED_SHOWN:
        print(f"... and {len(failed) - MALFORMED_SHOWN} more failed requests", file=err)
    if options.metrics_url:
        print_cache_tiers(options.metrics_url, out, err)
    return 1 if failed else 0


# The engine publishes its cache figures at most once a second (and once more about a second after its
# last step): read as the last answer arrives, they would not hold what this job filled yet
CACHE_FIGURES_PERIOD_S = 1.1
CACHE_FIGURES_LIMIT_S = 5.0


def print_cache_tiers(metrics_url: str, out: TextIO, err: TextIO) -> None:
    """What the job filled, as the server counts it: read until two reads a publishing period apart
    agree; a server whose metrics cannot be read is noted, not a failure of the job (the requests were
    sent and answered)."""
    from client.cache_report import format_rows, tier_rows
    from client.metrics import scrape_metrics

    try:
        rows = tier_rows(scrape_metrics(metrics_url))
        deadline = time.monotonic() + CACHE_FIGURES_LIMIT_S
        while time.monotonic() < deadline:
            time.sleep(CACHE_FIGURES_PERIOD_S)
            rows, before = tier_rows(scrape_metrics(metrics_url)), rows
            if rows == before:
                break
    except (OSError, ValueError) as exc:
        print(f"warning: cannot read the cache tiers at {metrics_url}: {exc}", file=err)
        return
    print("cache tiers after the warmup (cumulative since the engine started):", file=out)
    print(format_rows(rows), file=out)
