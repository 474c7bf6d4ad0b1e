"""Builds a ready Engine from an EngineConfig: checkpoint, tokenizer bytes, KV memory, warmup."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import yaml
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, GenerationConfig

from cache.fingerprint import model_max_len, model_vocab_size, serving_fingerprint
from cache.traffic_stats import RESERVED, StoreUnavailable, TrafficStatsStore, model_fingerprint
from engine.cache_sizing import host_available_bytes, plan_tiers
from engine.compile_cache import CompileCache, compile_cache_for
from engine.config import EngineConfig
from engine.detokenize import TokenDecoder
from engine.device_prewarm import DevicePrewarm, PrewarmShape
from engine.engine import Engine
from engine.gc_settle import settle_garbage_collector
from engine.model_runner import ModelRunner
from cache.kv_format import KVBlockMeta, dtype_name
from cache.key_directory import KeyDirectory
from cache.redis_topology import check_redis_url
from cache.response_cache import ExactResponseCache, exact_namespace, redact_url
from engine.kv_tiers import LAYOUT, L3Tier
from engine.l2_pool import HostBlockPool
from engine.response_tier import ResponseTier
from engine.prefix_cache import PrefixCache
from engine.slo_feedback import SloFeedbackLoop
from scheduler.feedback import FeedbackController
from engine.observer import EngineObserver
from engine.traffic_recorder import TrafficRecorder
from engine.warmup import StageTiming, WarmupReport, run_warmup, shape_order
from scheduler.admission import AdmissionController
from scheduler.kv_pools import KVPoolPlan, plan_kv_pools, single_pool
from scheduler.preemption import PreemptionPolicy
from scheduler.errors import RequestError
from scheduler.tenant_auth import SECRET_ENV, TRUST_ENV, TenantAuth
from scheduler.tiers import TierTable
from scheduler.tokenize import treat_special_tokens
from scheduler.validation import validate_tenant
from scheduler.warmup_planner import BucketPlan, plan_buckets, predict_reserve

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class LoadedEngine:
    engine: Engine
    report: WarmupReport
    load_seconds: float
    kv_bytes: int


def eos_token_ids(model_dir: Path, model_config) -> set[int]:
    ids: set[int] = set()
    candidates = [getattr(model_config, "eos_token_id", None)]
    if (model_dir / "generation_config.json").exists():
        candidates.append(GenerationConfig.from_pretrained(model_dir).eos_token_id)
    for value in candidates:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    return ids


@dataclass
class TrafficPlan:
    """What warmup and KV sizing take from recorded traffic (or the defaults when there is none)."""

    buckets: BucketPlan
    histogram: dict[int, int]
    kv: KVPoolPlan
    store: TrafficStatsStore | None
    failures: list[dict] = field(default_factory=list)

    @property
    def slots(self) -> int:
        return self.kv.slots


def plan_from_traffic(config: EngineConfig, model_dir: Path, max_len: int, model_name: str) -> TrafficPlan:
    """Read the model's traffic history from Redis; any failure falls back to the configured defaults."""
    histogram: dict[int, int] = {}
    reserved: dict[int, int] = {}
    peaks: list[tuple[float, float]] = []
    failures: list[dict] = []
    store = None
    if config.redis_url:
        try:
            store = TrafficStatsStore(config.redis_url, model_name, model_fingerprint(model_dir, max_len))
            histogram = store.load_lengths()
            reserved = store.load_lengths(RESERVED)
            peaks = store.load_peaks()
        except StoreUnavailable as exc:
            failures.append({"stage": "plan", "error": str(exc)})
        if store is not None and store.malformed:
            failures.append({"stage": "plan", "error": f"skipped {store.malformed} malformed traffic values"})
    try:
        buckets, kv = _plan(config, max_len, histogram, reserved, peaks)
    except Exception as exc:  # recorded traffic is data from Redis: a plan it breaks must not stop the load
        failures.append({"stage": "plan", "error": f"{type(exc).__name__}: {exc}"[:2000]})
        histogram = {}
        buckets, kv = _plan(config, max_len, histogram, {}, [])
    return TrafficPlan(buckets, histogram, kv, store, failures)


def _plan(
    config: EngineConfig,
    max_len: int,
    histogram: dict[int, int],
    reserved: dict[int, int],
    peaks: list[tuple[float, float]],
) -> tuple[BucketPlan, KVPoolPlan]:
    """Buckets and KV pools from recorded traffic; with none, the configured defaults."""
    buckets = plan_buckets(histogram, max_len, config.prompt_buckets, min_samples=config.plan_min_samples)
    slots = config.max_batch_size
    if config.plan_kv_from_traffic and peaks:
        predicted = predict_reserve(peaks, time.time(), config.peak_half_life_s, config.kv_headroom)
        slots = min(
            config.max_batch_size, max(config.min_batch_size, math.ceil(predicted), 1)
        )  # the cap last
    kv = single_pool(slots, max_len)
    if config.plan_kv_from_traffic and config.kv_length_classes:
        kv = plan_kv_pools(reserved, slots, max_len, buckets.buckets, min_samples=config.plan_min_samples)
    return buckets, kv


def check_redis(config: EngineConfig, log) -> None:
    """Refuse a Redis the caches cannot use (a cluster of several masters: UnsupportedRedis, a
    ValueError, so `initialize` fails naming it); a Redis that is down only gets a log line."""
    if not config.redis_url:
        return
    try:
        topology = check_redis_url(config.redis_url)
    except ImportError as exc:  # redis-py missing: every Redis tier logs itself off
        log(f"redis check skipped: {exc}")
        return
    log(f"redis {redact_url(config.redis_url)}: {topology.describe()}")


def key_directory(config: EngineConfig, namespace: str, log) -> KeyDirectory | None:
    """The local view of which keys of `namespace` Redis holds, following writers' announcements."""
    if not config.redis_key_directory:
        return None
    return KeyDirectory(
        config.redis_url, namespace, max_keys=config.redis_key_directory_max_keys, log=log
    ).start()


def build_l3(
    config: EngineConfig, model_name: str, fingerprint: str, runner: ModelRunner, log
) -> L3Tier | None:
    """The Redis KV tier, or None (no Redis configured, or redis-py missing: L1 keeps working alone)."""
    if not (config.l3_kv_cache and config.redis_url):
        return None
    try:
        from cache.circuit_breaker import CircuitBreaker
        from cache.cost_model import LoadCostModel
        from cache.redis_kv_store import RedisKVStore
    except ImportError as exc:
        log(f"L3 KV cache off: {exc}")
        return None
    shape = runner.shape
    meta = KVBlockMeta(
        model_fingerprint=fingerprint,
        dtype=dtype_name(runner.dtype),
        shape=(shape.layers, 2, shape.kv_heads, config.prefix_block_size, shape.head_dim),
        token_count=config.prefix_block_size,
        layout=LAYOUT,
    )
    # v2: values of kv_format version 2 (bound to their block key); replicas still on v1 in a rolling
    # update use other names, so neither deletes the other's values as incompatible
    namespace = f"llm:kv:v2:{model_name}"
    store = RedisKVStore(
        config.redis_url,
        namespace,
        ttl_s=config.l3_ttl_s,
        breaker=CircuitBreaker(),
        directory=key_directory(config, namespace, log),
        tenant_max_blocks=config.l3_tenant_max_blocks,
        compress=config.l3_compress,
    )
    return L3Tier(store, meta, cost=LoadCostModel(explore_every_s=config.l3_explore_s), ttl_s=config.l3_ttl_s)


def added_lead(tokenizer: Tokenizer) -> list[int]:
    """The ids the tokenizer puts in front of every encoded text (a BOS), which no prompt wrote."""
    plain = tokenizer.encode("a", add_special_tokens=False).ids
    full = tokenizer.encode("a").ids
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return full[:start]
    return []


def pair_check(config: EngineConfig):
    """The semantic cache's last check, or None when the config turns it off. Weights that do not load
    raise: a semantic cache without the check it was tuned with would serve more wrong answers, so the
    caller turns the semantic cache off instead."""
    if not config.semantic_pair_check:
        return None
    from cache import pair_classifier
    from cache.semantic_cache import PairCheck

    classifier = pair_classifier.PairClassifier.load(pair_classifier.DEFAULT_WEIGHTS)
    # concurrent semantic lookups share its passes
    return PairCheck(pair_classifier.CoalescingPairClassifier(classifier), config.semantic_pair_min)


def build_response_tier(
    config: EngineConfig, fingerprint: str, model_dir: Path, decoder, log
) -> ResponseTier | None:
    """The response caches on the serving path (exact, and semantic when enabled), or None without Redis."""
    if not (config.response_cache and config.redis_url):
        return None
    try:
        cache = ExactResponseCache(
            config.redis_url,
            fingerprint,
            directory=key_directory(config, exact_namespace(fingerprint), log),
            tenant_max_entries=config.exact_tenant_max_entries,
            vocab_size=model_vocab_size(model_dir),  # as the scheduler step keys
            device=config.device,
        )
    except ImportError as exc:
        log(f"response cache off: {exc}")
        return None
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    semantic = None
    if config.semantic_cache:
        try:
            from cache.embed_coalescer import CoalescerConfig, CoalescingEmbedder
            from cache.embedder import MiniLMEmbedder
            from cache.semantic_cache import SemanticResponseCache

            minilm = MiniLMEmbedder()  # concurrent lookups (and the writer's stores) share its passes
            embedder = CoalescingEmbedder(minilm, CoalescerConfig(max_texts=minilm.config.batch_size))
            semantic = SemanticResponseCache(
                config.redis_url,
                fingerprint,
                embedder,
                threshold=config.semantic_threshold,
                max_entries_per_tenant=config.semantic_tenant_max_entries,
                verifier="default" if config.semantic_verifier else None,
                pair_check=pair_check(config),
                device=config.device,
            )
        except (ImportError, OSError, ValueError) as exc:  # an optional package, or weights that do not load
            log(f"semantic cache off: {exc}")

    def answer_bytes(ids: list[int], trim_bytes: int) -> bytes:
        """Ids' text as the detokenizer sends it whole, less `trim_bytes` where a stop string began: for a
        sentencepiece tokenizer without the leading space `raw_bytes` keeps."""
        return decoder.delta(list(ids), 0, True, trim_bytes)

    special = {i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special}
    lead = added_lead(tokenizer)

    def prompt_text(ids: list[int]) -> tuple[str, str]:
        """A prompt as the semantic cache compares it: its text without special tokens, and as its
        variant the special tokens it holds past the tokenizer's own lead (BOS), which only an equal
        variant matches. A prompt that wrote "<s>" or "<pad>" tokenizes to them: dropped alone, "the <s>
        tag" and "the <pad> tag" were one question; spelled into the text, a chat template's tokens
        would fill the embedder's window with the same words in every prompt."""
        body = list(ids[len(lead) :]) if list(ids[: len(lead)]) == lead else list(ids)
        variant = ",".join(str(i) for i in body if i in special)
        return tokenizer.decode(body, skip_special_tokens=True), variant

    return ResponseTier(
        cache,
        answer_bytes,
        prompt_text=prompt_text,
        semantic=semantic,
        first_use=config.response_cache_first_use,
        log=log,
    )


def build_prefix_cache(
    config: EngineConfig, runner: ModelRunner, model_name: str, fingerprint: str, log: Callable[[str], None]
) -> PrefixCache | None:
    """L1 on the runner's device with L2 and L3 behind it, sized by `cache_sizing` (ValueError when a
    tier does not fit in the memory left: `initialize` fails naming the parameter, not with an OOM)."""
    block_bytes = runner.kv_bytes_per_token * config.prefix_block_size
    on_device = runner.device.type == "cuda"
    sizes = plan_tiers(
        config.cache_request(),
        block_bytes,
        on_device,
        torch.cuda.mem_get_info(runner.device)[0] if on_device else None,
        host_available_bytes(),
    )
    if sizes.l1_blocks == 0:
        return None
    cache = PrefixCache(runner, sizes.l1_blocks, config.prefix_block_size, fingerprint)
    cache.log = log
    cache.l3 = build_l3(config, model_name, fingerprint, runner, log)
    cache.publish_on_first_use = config.l3_publish_first_use
    if sizes.l2_blocks > 0:
        cache.l2 = HostBlockPool(
            sizes.l2_blocks, tuple(cache.pool.shape[1:]), cache.pool.dtype, pin=on_device
        )
    if cache.l2 is None:
        l2_note = ", no L2"
    elif on_device and not cache.l2.page_locked:
        l2_note = ", L2 pageable: CUDA refused to lock its pages, so its copies wait"
    else:
        l2_note = ""
    log(f"prefix cache: {sizes.describe()}{l2_note}")
    return cache


def load_templates(
    path: str, model_dir: Path, special_tokens: str = "text"
) -> tuple[list[tuple[list[int], str]], list[dict]]:
    """Hot prefixes from a YAML file ({templates: [{text, tenant}]}) as (token ids, tenant), in file
    order (= priority). A missing or malformed file is a warmup failure, never a load failure.
    `special_tokens`: how the scheduler step reads special tokens spelled in prompt text
    (`prompt_special_tokens`): a template is tokenized as the requests it serves, or it never hits."""
    if not path:
        return [], []
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
        tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        treat_special_tokens(tokenizer, special_tokens)
        prefixes = []
        for entry in data.get("templates", []):
            text = entry["text"]
            if not isinstance(text, str) or not text.strip():
                raise ValueError(f"template {entry!r} has no text")
            # as a request's: an empty tenant is "default", a bad name refused; a template warmed under
            # a name no request uses would hold pinned rows and never hit
            tenant = validate_tenant(entry.get("tenant"))
            prefixes.append((tokenizer.encode(text).ids, tenant))
        return prefixes, []
    except (
        OSError, yaml.YAMLError, KeyError, TypeError, ValueError, AttributeError, RequestError, RecursionError
    ) as exc:  # fmt: skip
        return [], [{"stage": "prefix_templates", "error": f"{path}: {type(exc).__name__}: {exc}"}]


@dataclass
class _Started:
    """What a load started that runs on its own (threads, Redis clients), to stop if the load fails."""

    prewarm: DevicePrewarm | None = None
    engine: Engine | None = None

    def stop(self) -> None:
        if self.prewarm is not None:
            self.prewarm.finish()
        if self.engine is not None:  # its prefetch, L3 tier, response caches, recorder, engine thread
            self.engine.shutdown(0.0)


def load_engine(
    config: EngineConfig,
    observer: EngineObserver | None = None,
    log: Callable[[str], None] = print,
    cancelled_elsewhere: Callable[[], set[str]] | None = None,
    model_name: str = "llm_engine",
    model_version: str = "",
) -> LoadedEngine:
    """A ready engine. A load that fails midway stops what it started first: the L3 prefetch, the
    L3 and response-cache writers, the key directories' subscriptions and the device prewarm otherwise
    kept running (and reconnecting to Redis) in a process that has no engine."""
    started = _Started()
    try:
        return _load_engine(started, config, observer, log, cancelled_elsewhere, model_name, model_version)
    except BaseException:
        started.stop()
        raise


def _load_engine(
    started_parts: _Started,
    config: EngineConfig,
    observer: EngineObserver | None,
    log: Callable[[str], None],
    cancelled_elsewhere: Callable[[], set[str]] | None,
    model_name: str,
    model_version: str,
) -> LoadedEngine:
    model_dir = Path(config.model_dir)
    if not (model_dir / "config.json").exists():
        raise FileNotFoundError(
            f"model_dir {model_dir} has no config.json; run `make model` or point model_dir at a checkpoint"
        )
    if config.device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(
            f"device={config.device} but CUDA is not available on this machine; use device=cpu"
        )
    torch.manual_seed(config.seed)
    started = time.perf_counter()
    started_ns = time.perf_counter_ns()
    check_redis(config, log)
    max_len = model_max_len(model_dir, config.max_seq_len)
    plan = plan_from_traffic(config, model_dir, max_len, model_name)
    plan_seconds = time.perf_counter() - started
    buckets = plan.buckets.buckets
    pools = [(pool.capacity, pool.slots) for pool in plan.kv.pools]
    prewarm = None
    if config.warmup and config.device_prewarm and config.device.startswith("cuda"):  # CPU: no gain, measured
        shape = PrewarmShape(plan.slots, max_len, buckets, pools, shape_order(buckets, plan.histogram))
        dtype = DTYPES[config.dtype]
        prewarm = DevicePrewarm(str(model_dir), dtype, config.device, shape, started_ns).start()
        started_parts.prewarm = prewarm
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[config.dtype])
    model = model.to(config.device).eval()
    try:
        runner = ModelRunner(model, plan.slots, max_len, buckets, pools)
    except (RuntimeError, MemoryError, OverflowError, TypeError) as exc:  # the allocator's words (or
        # torch's "Overflow when unpacking long long" for a size past int64) name no parameter: say which
        tokens = sum(capacity * count for capacity, count in pools)
        raise ValueError(
            f"the KV slots ({plan.slots} slots, {tokens} token positions: max_batch_size="
            f"{config.max_batch_size}, max_seq_len={max_len}) do not fit in {config.device} memory; lower "
            f"max_batch_size or max_seq_len ({type(exc).__name__}: {str(exc)[:200]})"
        ) from exc
    runner.use_cuda_graphs = config.cuda_graphs and runner.device.type == "cuda"
    runner.use_prefill_graphs = runner.use_cuda_graphs and config.prefill_graphs
    decoder = TokenDecoder.from_model_dir(model_dir)
    tiers = (TierTable.load(config.tiers_file) if config.tiers_file else TierTable.defaults()).for_device(
        config.device
    )
    engine = Engine(
        runner,
        lambda token: decoder.raw_bytes([token]),
        eos_token_ids(model_dir, model.config),
        buckets,
        observer,
        cancelled_elsewhere,
        tiers=tiers,
        queue_policy=config.queue_policy,
        max_queued=config.max_queued,
        max_new_tokens=config.max_new_tokens,
        admission=AdmissionController(tiers, max_queued=config.max_queued)
        if config.admission_control
        else None,
        preemption=PreemptionPolicy(config.max_preemptions) if config.preemption else None,
    )
    started_parts.engine = engine
    engine.log = log
    engine.byte_run_tokens = decoder.byte_ids
    engine.recorder = TrafficRecorder(plan.store, config.traffic_flush_s, on_error=log)
    engine.tenant_auth = TenantAuth.from_env()
    if not engine.tenant_auth.enabled:
        log(
            f"tenants taken as named ({TRUST_ENV}=true, no {SECRET_ENV}): any client may act as any tenant"
            if engine.tenant_auth.trust_client
            else f"{SECRET_ENV} unset: serving tenant 'default' only, requests naming another are refused"
        )
    elif engine.tenant_auth.previous is not None:
        log("tenant tokens of the previous secret still pass: drop it once the tokens are reissued")
    fingerprint = serving_fingerprint(model_dir, max_len, config.dtype)
    hot_prefixes, template_failures = load_templates(
        config.prefill_templates, model_dir, config.prompt_special_tokens
    )
    compile_cache: CompileCache | None = None
    compile_failures: list[dict] = []
    if config.compile and config.warmup:
        try:
            compile_cache = compile_cache_for(
                config.compile_cache_dir,
                model_name,
                model_version,
                fingerprint,
                model_dir,
                runner.slots,
                runner.device,
            )
        except Exception as exc:  # no compile then: the engine serves eager
            compile_failures.append({"stage": "compile", "error": f"{type(exc).__name__}: {exc}"})
    engine.responses = build_response_tier(config, fingerprint, model_dir, decoder, log)
    if engine.responses is not None and engine.responses.semantic is not None:
        engine.use_lookup_threads(config.semantic_lookup_threads)  # not to hold up the requests behind
    load_seconds = time.perf_counter() - started
    log(
        f"loaded {model_dir} on {runner.device} ({config.dtype}) in {load_seconds:.2f}s; "
        f"{runner.slots} slots in pools {pools}, KV {runner.kv_bytes / 2**20:.1f} MiB; "
        f"buckets {list(buckets)} ({plan.buckets.source})"
    )
    prewarm_stage = None if prewarm is None else prewarm.finish()
    # sized after the prewarm gave its memory back: allocated on its own stream, that memory counts as used
    # until `finish` empties the cache, and the device check would refuse an L1 that fits
    engine.prefix_cache = build_prefix_cache(config, runner, model_name, fingerprint, log)
    report = run_warmup(
        engine,
        config.warmup,
        config.warmup_budget_s,
        plan.histogram,
        hot_prefixes=hot_prefixes,
        prefill_budget_s=config.prefill_budget_s,
        compile_cache=compile_cache,
        l3_prefetch=config.l3_prefetch,
        graph_budget_s=config.prefill_graph_budget_s,
        origin_ns=started_ns,  # the prewarm's spans are since the load's start too: one time line
    )
    report.stages.insert(0, StageTiming("plan", plan_seconds, len(plan.histogram)))
    if prewarm_stage is not None:
        report.stages.insert(1, prewarm_stage)
        report.device_prewarm = asdict(prewarm.summary)
        report.total_seconds += prewarm.summary.waited_s
        if prewarm.summary.error:
            report.failures.append({"stage": "device_prewarm", "error": prewarm.summary.error})
    report.failures[:0] = plan.failures + template_failures + compile_failures
    report.plan = {
        "source": plan.buckets.source,
        "samples": plan.buckets.samples,
        "cuts": plan.buckets.cuts,
        "slots": plan.slots,
        "kv": plan.kv.as_dict(),
    }
    settle_garbage_collector()
    engine.ready = True
    engine.recorder.start()
    engine.feedback = SloFeedbackLoop(
        config.redis_url,
        model_name,
        tiers,
        FeedbackController(tiers),
        engine.apply_feedback,
        config.feedback_interval_s,
        log,
    )
    engine.start()
    engine.feedback.start()
    return LoadedEngine(engine, report, load_seconds, runner.kv_bytes)
