"""Builds a ready Engine from an EngineConfig: checkpoint, tokenizer bytes, KV memory, warmup."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from engine.config import EngineConfig
from engine.detokenize import TokenDecoder
from engine.engine import Engine
from engine.gc_settle import settle_garbage_collector
from engine.model_runner import ModelRunner
from engine.observer import EngineObserver
from engine.warmup import WarmupReport, run_warmup

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


def load_engine(
    config: EngineConfig,
    observer: EngineObserver | None = None,
    log: Callable[[str], None] = print,
    cancelled_elsewhere: Callable[[], set[str]] | None = None,
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
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[config.dtype])
    model = model.to(config.device).eval()
    runner = ModelRunner(model, config.max_batch_size, config.max_seq_len, config.prompt_buckets)
    decoder = TokenDecoder.from_model_dir(model_dir)
    engine = Engine(
        runner,
        lambda token: decoder.raw_bytes([token]),
        eos_token_ids(model_dir, model.config),
        config.prompt_buckets,
        observer,
        cancelled_elsewhere,
    )
    load_seconds = time.perf_counter() - started
    log(
        f"loaded {model_dir} on {runner.device} ({config.dtype}) in {load_seconds:.2f}s; "
        f"KV {runner.kv_bytes / 2**20:.1f} MiB"
    )
    report = run_warmup(engine, config.warmup)
    settle_garbage_collector()
    engine.ready = True
    engine.start()
    return LoadedEngine(engine, report, load_seconds, runner.kv_bytes)
