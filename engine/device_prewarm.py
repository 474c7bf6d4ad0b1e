"""Kernel first-use costs paid on a thread while the weights load.

On CUDA the first call of each kernel loads its module (lazy loading) and cuBLAS, cuBLASLt and flash
attention set up handles, workspaces and heuristics per shape. On the H200 (1B preset) the first
warmed bucket took 0.4-0.5 s for that alone, and the sampling path (top-k, sort, multinomial) another
0.13-0.22 s: all of it inside the warmup stage, after the weights were loaded. None of it needs the
real weights. So, while the main thread loads them, this thread runs the same engine code on a
one-layer copy of the architecture with random weights (same hidden sizes, heads, vocabulary, dtype,
slots and KV pools): the kernels, GEMM shapes and sampling path of the real warmup, at a fraction of
its cost. It stops between items as soon as the load is done (`finish`), so it never delays READY by
more than one item; whatever it did not reach, the warmup stage pays as before.
"""

from __future__ import annotations

import copy
import gc
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import AutoConfig, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from engine.model_runner import ModelRunner
from engine.sampling import warm_sampling
from engine.warmup import StageTiming


@dataclass
class PrewarmSummary:
    """What the thread did; seconds are relative to `origin_ns` like the warmup report's spans."""

    items: int = 0
    planned: int = 0
    start_s: float | None = None
    end_s: float | None = None
    seconds: float = 0.0
    waited_s: float = 0.0  # how long `finish` blocked: the part not hidden behind the load
    error: str | None = None
    done: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class PrewarmShape:
    """The engine geometry the prewarm copies (known after planning, before the weights load)."""

    slots: int
    max_len: int
    buckets: tuple[int, ...]
    pools: Sequence[tuple[int, int]]
    order: Sequence[int]  # prompt buckets, most used first


class DevicePrewarm:
    """Runs the prewarm on its own thread and CUDA stream; `finish()` stops it and returns the summary."""

    def __init__(self, model_dir: str, dtype: torch.dtype, device: str, shape: PrewarmShape, origin_ns: int):
        """`origin_ns` (perf_counter_ns) anchors the summary's spans: the start of the load."""
        self.model_dir = model_dir
        self.dtype = dtype
        self.device = torch.device(device)
        self.shape = shape
        self.origin_ns = origin_ns
        self.summary = PrewarmSummary()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="device-prewarm", daemon=True)

    def start(self) -> DevicePrewarm:
        self._thread.start()
        return self

    def finish(self, stop: bool = True) -> StageTiming:
        """Stop after the current item (or, with `stop=False`, let every item run), wait, and time
        the stage (spans since `origin_ns`)."""
        waiting = time.perf_counter_ns()
        if stop:
            self._stop.set()
        self._thread.join()
        if self.device.type == "cuda":  # the copy's memory was cached for the prewarm's stream only
            gc.collect()  # the one-layer model holds reference cycles, which the loader's gc.freeze() keeps
            torch.cuda.empty_cache()
        summary = self.summary
        summary.waited_s = (time.perf_counter_ns() - waiting) / 1e9
        return StageTiming(
            "device_prewarm", summary.seconds, summary.items, None, summary.start_s, summary.end_s
        )

    def _run(self) -> None:
        started = time.perf_counter_ns()
        self.summary.start_s = (started - self.origin_ns) / 1e9
        try:
            if self.device.type == "cuda":
                stream = torch.cuda.Stream(self.device)
                with torch.cuda.stream(stream):
                    self._work()
                stream.synchronize()
            else:
                self._work()
        except Exception as exc:  # the warmup stage then pays these costs itself
            self.summary.error = f"{type(exc).__name__}: {exc}"
        ended = time.perf_counter_ns()
        self.summary.end_s = (ended - self.origin_ns) / 1e9
        self.summary.seconds = (ended - started) / 1e9

    @torch.inference_mode()
    def _work(self) -> None:
        shape = self.shape
        config = AutoConfig.from_pretrained(self.model_dir)
        warm_sampling(config.vocab_size, shape.slots, self.device)  # needs no model: first
        self._done("sampling", 0)
        if self._stop.is_set():  # the load ended during sampling: the model copy is not the next item's
            return
        runner = self._one_layer_runner(config)
        items = [("prefill", bucket) for bucket in shape.order]
        items += [("decode", bucket) for bucket in runner.kv_buckets]
        self.summary.planned = 1 + len(items)
        for kind, bucket in items:
            if self._stop.is_set():
                return
            runner.warm_shape(kind, bucket)
            self._done(kind, bucket)

    def _done(self, kind: str, bucket: int) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self.summary.items += 1
        self.summary.done.append(f"{kind}:{bucket}" if bucket else kind)

    def _one_layer_runner(self, config: PretrainedConfig) -> ModelRunner:
        config = copy.deepcopy(config)
        config.num_hidden_layers = 1
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[:1]
        config.tie_word_embeddings = True  # the same lm_head GEMM, half the memory
        # The class itself, not from_config: HF's constructors set torch's *global* default dtype for
        # their duration, which would race with the main thread's from_pretrained. Built on the meta
        # device and given uninitialized memory: the kernels do not care about the values, and a
        # random init of the embedding and lm_head would be wasted work competing with the load.
        with torch.device("meta"):
            model = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)](config)
        model = model.to(dtype=self.dtype).to_empty(device=self.device).eval()
        shape = self.shape
        runner = ModelRunner(model, shape.slots, shape.max_len, shape.buckets, shape.pools)
        runner.use_cuda_graphs = False  # eager: captures belong to the real runner
        return runner
