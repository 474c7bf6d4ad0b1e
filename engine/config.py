"""Engine configuration, read from Triton model-config parameters (always strings)."""

from __future__ import annotations

import difflib
import math
import threading
import os
import re
from dataclasses import dataclass, field, fields

from engine.cache_sizing import CacheRequest, parse_memory
from scheduler.sampling_rules import DEFAULT_MAX_NEW_TOKENS
from scheduler.tokenize import PROMPT_SPECIAL_TOKENS

_ENV_REF = re.compile(r"^\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?::-(?P<default>.*))?\}$")


def expand_env(value: str) -> str:
    """Resolve `${NAME:-default}` so one config.pbtxt serves CPU dev, GPU bench and containers."""
    match = _ENV_REF.match(value.strip())
    if not match:
        return value
    return os.environ.get(match["name"]) or (match["default"] or "")  # `:-`: unset or empty, as in a shell


def triton_warmup_requests(model_config: dict) -> int:
    """How many requests Triton's `model_warmup` samples send: Triton sends them after initialize() and
    before the model is READY, so nothing else can reach it first; those are the engine's own (they need
    no token at a restricted tier). As Triton's core does it (backend_model_instance.cc): a sample of
    batch_size 0 (or none) is skipped, others send batch_size requests max(count, 1) times."""
    total = 0
    for sample in model_config.get("model_warmup", []):
        batch = int(sample.get("batch_size") or 0)
        if batch > 0:
            total += batch * max(int(sample.get("count") or 0), 1)
    return total


def parse_bool(key: str, value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"parameter {key}={value!r} is not a boolean; use true/false")


def _parse_int_list(key: str, value: str) -> tuple[int, ...]:
    try:
        items = tuple(sorted({int(part) for part in value.split(",") if part.strip()}))
    except ValueError as exc:
        raise ValueError(f"parameter {key}={value!r} must be comma-separated integers") from exc
    if any(item <= 0 for item in items):
        raise ValueError(f"parameter {key}={value!r} must hold positive integers")
    return items


# (parameter, least value, what the least means): checked by `EngineConfig.validate`
MINIMUMS = (
    ("semantic_lookup_threads", 0, " (0: inline)"),
    ("semantic_tenant_max_entries", 1, ""),
    ("exact_tenant_max_entries", 0, " (0: no quota)"),
    ("l3_tenant_max_blocks", 0, " (0: no quota)"),
    ("l3_explore_s", 0, " (0: never explore)"),
    ("prefix_block_size", 1, " token"),
    ("max_new_tokens", 1, ""),
    ("min_batch_size", 1, " (a traffic plan's floor of slots)"),
    ("max_queued", 0, ""),
    ("max_preemptions", 0, ""),
    ("plan_min_samples", 0, ""),
    ("redis_key_directory_max_keys", 0, ""),
    ("seed", 0, ""),
    # a period of 0 made these loops run without pause against Redis, a core busy for good
    ("traffic_flush_s", 0.1, " seconds"),
    ("feedback_interval_s", 0.1, " seconds"),
    ("l3_ttl_s", 1.0, " seconds"),
    ("peak_half_life_s", 1.0, " seconds"),
    ("kv_headroom", 0.01, " (a factor on the recorded peak)"),
)


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs; `from_parameters` names the config.pbtxt keys (same as fields)."""

    model_dir: str = ""
    device: str = "cpu"
    dtype: str = "float32"
    max_batch_size: int = 8
    max_seq_len: int = 2048
    # the scheduler step's cap on max_tokens (the same LLM_MAX_NEW_TOKENS), enforced on direct requests too
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    warmup: bool = True
    prompt_buckets: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024, 2048)
    min_batch_size: int = 2
    warmup_budget_s: float = 0.0
    cuda_graphs: bool = True
    prefill_graphs: bool = True  # with cuda_graphs: prefills per bucket as CUDA graphs too
    prefill_graph_budget_s: float = 1.0  # warmup time for prefill graphs (each warms its bucket)
    device_prewarm: bool = True  # CUDA: kernel first-use costs paid on a thread while the weights load
    compile: bool = False  # torch.compile the decode step per KV bucket during warmup
    compile_cache_dir: str = "/tmp/llm-compile-cache"  # keyed per model version inside (compile_cache.py)
    tiers_file: str = ""
    queue_policy: str = "slo"
    max_queued: int = 256
    admission_control: bool = True
    preemption: bool = True
    max_preemptions: int = 2
    feedback_interval_s: float = 5.0
    prefix_cache_blocks: int = 256
    prefix_block_size: int = 16
    l2_cache_blocks: int = 1024
    prefix_cache_memory: str = ""  # e.g. "8GiB": L1's size in device memory, instead of prefix_cache_blocks
    l2_cache_memory: str = ""  # e.g. "32GiB": L2's size in pinned host memory, instead of l2_cache_blocks
    l3_kv_cache: bool = True
    l3_ttl_s: float = 86400.0
    l3_explore_s: float = 60.0  # a replica recomputing L3 prefixes still loads one a period (0: never)
    l3_publish_first_use: bool = False  # write every new block to Redis (default: on reuse, and warmup)
    l3_tenant_max_blocks: int = 0  # the most L3 blocks one tenant keeps in Redis (0: no quota)
    # zlib (level 1) on L3 values: less Redis memory and network for more CPU on the writer thread and
    # every load; off by default: KV bytes compress little (to 0.80 of their size in bfloat16, 0.93 in
    # float32: the tiny model's, 2026-12-01) and a load is on the request path. Readers decode both
    l3_compress: bool = False
    l3_prefetch: bool = True  # fetch the hot prefixes' L3 blocks on a thread during kernel warmup
    response_cache: bool = True
    response_cache_first_use: bool = False  # write every answer (default: on its prompt's second sighting)
    exact_tenant_max_entries: int = 0  # the most exact answers one tenant keeps in Redis (0: no quota)
    semantic_cache: bool = False
    semantic_threshold: float = 0.82
    semantic_tenant_max_entries: int = 10000  # per tenant: its lookup compares every entry's vector
    semantic_verifier: bool = True  # the lower cosine band, checked by cache/semantic_verifier.json
    semantic_pair_check: bool = True  # every would-be hit also passes cache/pair_classifier.safetensors
    semantic_pair_min: float = 0.3  # its cut (bench/results/semantic-cache-cpu.md)
    # threads that run semantic lookups off the execute thread (0: inline). 4, not 2, since their embed
    # calls share MiniLM passes (cache/embed_coalescer.py) and more lookups under way put more texts in a
    # pass. bench.lookup_offload, CPU, 8 greedy misses at once, 6 runs (the last: lookup-offload-cpu.md):
    # the burst's last first token at 101-155 ms with 4 threads (2 texts a pass) against 128-199 with 2 as
    # before, 4 the earlier by 16-52 ms in every run; the median within noise, the sampled request's 0-2
    # ms later. 8 threads ended about as early as 4 and their median came 7-16 ms later (one text alone in
    # the first pass, seven waiting for the second); 8 without coalescing was no better than 2.
    semantic_lookup_threads: int = 4
    prefill_templates: str = ""
    prefill_budget_s: float = 0.3
    prompt_special_tokens: str = "text"  # as the scheduler step's: how templates read "</s>" in their text
    redis_url: str = ""
    redis_key_directory: bool = True  # know locally which keys Redis holds: a miss costs no round trip
    redis_key_directory_max_keys: int = 1_000_000  # per namespace; ~175 bytes a key in the engine process
    traffic_flush_s: float = 5.0
    plan_min_samples: int = 50
    plan_kv_from_traffic: bool = True
    kv_length_classes: bool = True  # one slot pool per length class, sized from recorded traffic
    peak_half_life_s: float = 6 * 3600.0
    kv_headroom: float = 1.5
    drain_timeout_s: float = 10.0
    cancel_dir: str = "/tmp/llm-cancel"
    seed: int = 0
    extra: dict[str, str] = field(default_factory=dict, compare=False)

    @classmethod
    def from_parameters(cls, params: dict[str, str]) -> EngineConfig:
        known = {f.name: f for f in fields(cls) if f.name != "extra"}
        values: dict[str, object] = {}
        extra: dict[str, str] = {}
        for key, raw in params.items():
            value = expand_env(raw)
            if key not in known:
                if not key.isupper():  # upper case: the Python backend's own (EXECUTION_ENV_PATH, ...)
                    near = difflib.get_close_matches(key, known, n=1)
                    hint = f"; did you mean {near[0]!r}?" if near else ""
                    raise ValueError(f"unknown parameter {key!r} in the engine's config.pbtxt{hint}")
                extra[key] = value
                continue
            default = getattr(cls, key, None)
            if isinstance(default, bool):
                values[key] = parse_bool(key, value)
            elif isinstance(default, int):
                values[key] = _int(key, value)
            elif isinstance(default, float):
                values[key] = _float(key, value)
            elif key == "prompt_buckets":
                values[key] = _parse_int_list(key, value)
            else:
                values[key] = value
        config = cls(**values, extra=extra)
        config.validate()
        return config

    def validate(self) -> None:
        if not self.model_dir:
            raise ValueError("parameter model_dir is empty; set it to a Hugging Face checkpoint directory")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"parameter device={self.device!r}; allowed: cpu, cuda, cuda:N")
        if self.dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"parameter dtype={self.dtype!r}; allowed: float32, float16, bfloat16")
        if self.prompt_special_tokens not in PROMPT_SPECIAL_TOKENS:
            raise ValueError(
                f"parameter prompt_special_tokens={self.prompt_special_tokens!r}; allowed: "
                + ", ".join(PROMPT_SPECIAL_TOKENS)
            )
        if self.max_batch_size < 1 or self.max_seq_len < 2:
            raise ValueError("max_batch_size must be >= 1 and max_seq_len >= 2")
        if self.prefix_cache_blocks < 0 or self.l2_cache_blocks < 0:
            raise ValueError("prefix_cache_blocks and l2_cache_blocks must be >= 0 (0: that tier is off)")
        for name, least, meaning in MINIMUMS:
            if getattr(self, name) < least:
                raise ValueError(f"{name} must be >= {least}{meaning}, got {getattr(self, name)}")
        for f in fields(self):
            value = getattr(self, f.name)
            # sizes end up in tensor shapes and C longs: past int64 torch raised a TypeError naming nothing
            if isinstance(value, int) and not isinstance(value, bool) and value >= 2**63:
                raise ValueError(f"parameter {f.name} must be < 2**63, got {value}")
        if not 0.0 < self.semantic_threshold <= 1.0:
            raise ValueError(f"semantic_threshold is a cosine in (0, 1], got {self.semantic_threshold}")
        if not 0.0 <= self.semantic_pair_min <= 1.0:
            raise ValueError(f"semantic_pair_min is a probability in [0, 1], got {self.semantic_pair_min}")
        for f in fields(self):
            value = getattr(self, f.name)
            # at most what a thread may wait: the timing parameters end up as wait() timeouts, which raise
            # OverflowError past it (a budget of 1e12 s crashed the warmup stage it was meant to leave alone)
            if isinstance(value, float) and not (
                math.isfinite(value) and 0 <= value <= threading.TIMEOUT_MAX
            ):
                raise ValueError(
                    f"parameter {f.name}={value!r} must be a finite number in [0, {threading.TIMEOUT_MAX:g}]"
                )
        self.cache_request()

    def cache_request(self) -> CacheRequest:
        """The configured cache sizes; ValueError names a malformed memory size."""
        return CacheRequest(
            self.prefix_cache_blocks,
            self.l2_cache_blocks,
            parse_memory("prefix_cache_memory", self.prefix_cache_memory),
            parse_memory("l2_cache_memory", self.l2_cache_memory),
        )

    def buckets_for(self, max_len: int) -> tuple[int, ...]:
        """Prompt buckets capped at the sequence limit, always ending at the limit itself."""
        capped = [b for b in self.prompt_buckets if b < max_len]
        return tuple(capped) + (max_len,)


def _int(key: str, value: str) -> int:
    try:
        return int(value)
    except ValueError as exc:
        raise ValueError(f"parameter {key}={value!r} is not an integer") from exc


def _float(key: str, value: str) -> float:
    try:
        return float(value)
    except ValueError as exc:
        raise ValueError(f"parameter {key}={value!r} is not a number") from exc
