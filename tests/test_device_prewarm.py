"""The kernel prewarm that overlaps the weight load (engine/device_prewarm.py), on the CPU.

Its point is CUDA's lazy module loading (measured by bench.coldstart on the GPU); here: it runs the
engine's own code on a one-layer copy of the model, stops when asked, and never raises."""

import pytest
import torch

from engine.device_prewarm import DevicePrewarm, PrewarmShape
from tests.conftest import MODEL_DIR

BUCKETS = (16, 32, 64, 128)


@pytest.fixture(scope="module")
def tiny_model_dir():
    if not (MODEL_DIR / "config.json").exists():
        from engine.build_model import build

        build("tiny", MODEL_DIR)
    return MODEL_DIR


def shape(**overrides) -> PrewarmShape:
    fields = dict(slots=3, max_len=128, buckets=BUCKETS, pools=[(32, 2), (128, 1)], order=(32, 16, 64, 128))
    fields.update(overrides)
    return PrewarmShape(**fields)


def test_prewarm_runs_sampling_then_the_prompt_buckets_most_used_first_then_decode(tiny_model_dir):
    prewarm = DevicePrewarm(str(tiny_model_dir), torch.float32, "cpu", shape(), origin_ns=0).start()
    stage = prewarm.finish(stop=False)
    summary = prewarm.summary
    assert summary.error is None
    assert summary.done == [
        "sampling",
        *(f"prefill:{b}" for b in (32, 16, 64, 128)),
        *(f"decode:{b}" for b in BUCKETS),
    ]
    assert stage.name == "device_prewarm" and stage.items == summary.planned == 9
    assert 0 < stage.start_s < stage.end_s and stage.seconds > 0


def test_finish_stops_the_prewarm_between_items(tiny_model_dir):
    prewarm = DevicePrewarm(str(tiny_model_dir), torch.float32, "cpu", shape(), origin_ns=0).start()
    stage = prewarm.finish()
    assert prewarm.summary.error is None
    assert stage.items < prewarm.summary.planned or prewarm.summary.planned == 0


def test_a_broken_model_dir_is_reported_not_raised(tmp_path):
    prewarm = DevicePrewarm(str(tmp_path), torch.float32, "cpu", shape(), origin_ns=0).start()
    stage = prewarm.finish(stop=False)
    assert stage.items == 0 and prewarm.summary.error


def test_the_loader_prewarms_on_cuda_only(tiny_model_dir):
    from engine.config import EngineConfig
    from engine.loader import load_engine

    config = EngineConfig(
        model_dir=str(tiny_model_dir), device="cpu", response_cache=False, prefill_templates="", redis_url=""
    )
    loaded = load_engine(config, log=lambda message: None)
    try:
        assert "device_prewarm" not in [s.name for s in loaded.report.stages]
        assert loaded.report.device_prewarm == {}
    finally:
        loaded.engine.shutdown(1.0)


def test_prewarm_beside_a_bf16_load_leaves_its_dtype_and_the_default_dtype_alone(tiny_model_dir):
    """HF constructors set torch's global default dtype while they run; the prewarm must not race them."""
    from transformers import AutoModelForCausalLM

    for _ in range(3):
        prewarm = DevicePrewarm(str(tiny_model_dir), torch.bfloat16, "cpu", shape(), origin_ns=0).start()
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
        prewarm.finish(stop=False)
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
        assert torch.get_default_dtype() == torch.float32
        assert prewarm.summary.error is None and prewarm.summary.items == prewarm.summary.planned
