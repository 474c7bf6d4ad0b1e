"""The warmup report's `start_s`/`end_s` place every stage on one time line (INTERNALS: "present on every
stage but "plan", place it beside the kernel stages"; PrewarmSummary: "relative to origin_ns like the warmup
report's spans"). The loader anchors the device prewarm's span at the start of the load, while run_warmup
anchors every other stage (and the l3_prefetch span) at its own start, seconds later. So the report showed a
prewarm that ran during the weight load as if it overlapped the kernel stages that came after it.

The prewarm runs on CUDA only; here the loader is made to take the CPU for a CUDA device so that the real
DevicePrewarm runs beside the real weight load (it works on the CPU: tests/test_device_prewarm.py)."""

from __future__ import annotations

import torch

import engine.loader as loader
from engine.config import EngineConfig
from tests.conftest import MODEL_DIR


class _CudaNamedCpu(str):
    """'cpu', but the loader's `device.startswith("cuda")` checks take it for a CUDA device."""

    def startswith(self, prefix, *args):  # noqa: D401
        return prefix == "cuda" or str.startswith(self, prefix, *args)


def test_the_prewarm_span_is_on_the_warmup_stages_time_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    config = EngineConfig(
        model_dir=str(MODEL_DIR), device=_CudaNamedCpu("cpu"), response_cache=False, prefill_templates="",
        redis_url="", prompt_buckets=(16,), max_seq_len=64, max_batch_size=2, device_prewarm=True,
    )  # fmt: skip
    loaded = loader.load_engine(config, log=lambda message: None)
    try:
        report = loaded.report
        stages = {stage.name: stage for stage in report.stages}
        assert report.device_prewarm and "device_prewarm" in stages
        prewarm = stages["device_prewarm"]
        first_kernel_start = min(stages[name].start_s for name in ("prefill_buckets", "decode_kv_buckets"))
        # the prewarm ran during the load and was joined (finish) before the warmup stage began
        assert prewarm.end_s is not None and prewarm.end_s <= first_kernel_start
        assert prewarm.start_s < prewarm.end_s
    finally:
        loaded.engine.shutdown(1.0)
