"""The report's `prefill_loaded` (and the prefix_templates stage's items, and the metric
`prefill_items{outcome="loaded"}`) must count templates that went into the prefix cache. Without a prefix
cache (prefix_cache_blocks=0, with the shipped config's prefill_templates.yaml still configured),
`Engine.prefill_template` returns at once having loaded nothing, yet every template was counted loaded."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine.engine import Engine
from engine.model_runner import ModelRunner
from engine.warmup import run_warmup

BUCKETS = (8, 16, 32, 64)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, max_position_embeddings=128, eos_token_id=2,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def test_templates_are_not_counted_loaded_without_a_prefix_cache(model):
    runner = ModelRunner(model, slots=2, max_len=128, kv_buckets=BUCKETS)
    engine = Engine(runner, lambda t: bytes([97 + t % 26]), {2}, BUCKETS)
    assert engine.prefix_cache is None
    templates = [([1] + list(range(10, 50)), "default"), ([1] + list(range(60, 90)), "default")]
    report = run_warmup(engine, enabled=True, hot_prefixes=templates, prefill_budget_s=30.0)
    assert report.failures == []
    assert report.prefill_loaded == 0
    assert next(s for s in report.stages if s.name == "prefix_templates").items == 0
