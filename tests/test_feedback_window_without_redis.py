"""Without a redis_url (config.pbtxt's default: only the launcher sets one) the SLO feedback loop starts
no thread, so nothing ever takes its latency window; the engine still appended every request's TTFT to it:
one float per request for the process's life. A window must be bounded however long nobody takes it.
(found in review, 2026-12-07)"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import engine.slo_feedback as slo_feedback
from engine.engine import Engine
from engine.model_runner import ModelRunner
from engine.requests import EngineRequest
from engine.slo_feedback import SloFeedbackLoop, TierLatencyWindow
from scheduler.feedback import FeedbackController
from scheduler.messages import EngineRequestParams

BUCKETS = (8, 16, 32, 64)
LIMIT = 50


@pytest.fixture(autouse=True)
def small_bound(monkeypatch):
    monkeypatch.setattr(slo_feedback, "MAX_WINDOW_SAMPLES", LIMIT, raising=False)


class Sink:
    def __init__(self):
        self.done = False

    def send(self, token_ids, read_offset, final, trim_bytes=0):
        self.done = self.done or final

    def fail(self, code, message):
        self.done = True

    def cancelled(self):
        return False


def held(window: TierLatencyWindow) -> int:
    return sum(len(samples) for samples in window._samples.values())


def test_an_untaken_window_stays_bounded():
    window = TierLatencyWindow()
    for i in range(1000):
        window.observe("standard", float(i))
    assert held(window) <= LIMIT
    taken = window.take()["standard"]
    assert list(taken)[-1] == 999.0  # the most recent samples are the ones kept


def test_engine_without_redis_keeps_no_growing_window():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=300, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=64, max_position_embeddings=64, eos_token_id=2,
    )  # fmt: skip
    runner = ModelRunner(LlamaForCausalLM(config).eval(), slots=2, max_len=64, kv_buckets=BUCKETS)
    engine = Engine(runner, lambda t: bytes([97 + t % 26]), {2}, BUCKETS)
    # as engine/loader.py builds it, with config.redis_url at its default ""
    engine.feedback = SloFeedbackLoop(
        "", "m", engine.tiers, FeedbackController(engine.tiers), engine.apply_feedback
    )
    engine.feedback.start()
    try:
        for i in range(200):
            sink = Sink()
            params = EngineRequestParams(max_tokens=1, ignore_eos=True)
            engine.submit(EngineRequest(f"id-{i}", [1, 5, 7, i % 200 + 3], params, 3, 0, sink))
            while engine.step():
                pass
            assert sink.done
        assert held(engine.feedback.window) <= LIMIT, f"{held(engine.feedback.window)} samples held"
    finally:
        engine.feedback.stop()
