"""CUDA-only engine checks (run on the GPU machine; skipped where there is no CUDA device)."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine.model_runner import ModelRunner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture
def model():
    """A small random Llama on the GPU, the same for every test (seeded)."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=500, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=256, max_position_embeddings=256,
    )  # fmt: skip
    return LlamaForCausalLM(config).cuda().eval()


@pytest.mark.parametrize("pools", [None, [(16, 2), (256, 2)]], ids=["one-pool", "length-classes"])
def test_decode_graph_replays_match_eager_decode(model, pools):
    runner = ModelRunner(model, slots=4, max_len=256, kv_buckets=(16, 64), pools=pools)
    for slot, prompt in enumerate(([1, 5, 9], [1, 7, 7, 7, 7, 7])):
        runner.prefill(slot, prompt, 16)
    tokens = torch.tensor([11, 12, 0, 0], device="cuda")
    positions = torch.tensor([3, 6, 0, 0], device="cuda")
    eager = runner.decode(tokens, positions, 64).clone()
    runner.capture_decode_graph(64)
    assert runner.graph_buckets == (64,)
    for slot, prompt in enumerate(([1, 5, 9], [1, 7, 7, 7, 7, 7])):
        runner.prefill(slot, prompt, 16)
    replayed = runner.decode(tokens, positions, 64)
    torch.testing.assert_close(replayed, eager, atol=1e-4, rtol=1e-4)


def test_warmup_stages_carry_cuda_event_times_beside_host_times(model):
    from engine.engine import Engine
    from engine.warmup import run_warmup

    runner = ModelRunner(model, slots=2, max_len=256, kv_buckets=(16, 64))
    engine = Engine(runner, lambda t: bytes([97 + t % 26]), {2}, (16, 64))
    report = run_warmup(engine, enabled=True)
    for stage in report.stages:
        assert stage.device_seconds is not None and 0 <= stage.device_seconds <= stage.seconds * 1.05
