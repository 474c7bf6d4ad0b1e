"""An answer cut short by its slot ("length" before max_tokens, because prompt + max_tokens exceeds
max_len) is kept by the exact cache only: its own prompt is cut the same way again. The cut depends on
the stored prompt's length, which a semantic match does not see: a paraphrase with a shorter prompt,
whose own generation runs to max_tokens, was served the cut answer. Found in review (and that the
exact cache then lost such answers, in a second review)."""

from __future__ import annotations

import uuid
from dataclasses import replace

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

from conftest import MODEL_DIR
from engine.detokenize import TokenDecoder
from engine.engine import Engine
from engine.loader import build_response_tier
from engine.model_runner import ModelRunner
from scheduler.messages import EngineRequestParams
from tests.test_engine_batching import RecordingSink, request, run_until_idle
from tests.test_response_tier_special_tokens import semantic_tier_config

MAX_LEN = 48


@pytest.fixture
def engine(redis_server):
    if not (MODEL_DIR / "config.json").exists():
        from engine.build_model import build

        build("tiny", MODEL_DIR)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR).eval()
    runner = ModelRunner(model, slots=2, max_len=MAX_LEN, kv_buckets=(16, 32))
    decoder = TokenDecoder.from_model_dir(MODEL_DIR)
    engine = Engine(runner, lambda t: decoder.raw_bytes([t]), {1}, (16, 32))
    config = semantic_tier_config(redis_server)
    fingerprint = f"fp-{uuid.uuid4().hex[:8]}"
    engine.new_tier = lambda: build_response_tier(config, fingerprint, MODEL_DIR, decoder, lambda m: None)
    engine.responses = engine.new_tier()
    yield engine
    engine.responses.close()


def run(engine: Engine, prompt: list[int], params: EngineRequestParams) -> RecordingSink:
    sink = RecordingSink()
    engine.submit(request(prompt, sink, **vars(params)))
    run_until_idle(engine)
    assert not sink.errors
    return sink


def test_an_answer_cut_by_its_slot_is_not_kept_for_a_paraphrase(engine):
    assert engine.responses.semantic is not None
    tokenizer = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))  # as the scheduler step: BOS in
    long_q = tokenizer.encode("What is the capital of France? " + "! ? " * 13).ids
    short_q = tokenizer.encode("What is the capital of France?").ids
    params = EngineRequestParams(
        max_tokens=30, ignore_eos=True, stream=True, tenant=f"t{uuid.uuid4().hex[:6]}"
    )
    assert len(long_q) + params.max_tokens > MAX_LEN >= len(short_q) + params.max_tokens

    cut = run(engine, long_q, params)
    assert len(cut.tokens) < params.max_tokens  # its slot was full first
    engine.responses.close()  # drains the writer: every write has landed
    engine.responses = engine.new_tier()
    own = run(engine, short_q, replace(params, cache="kv-only"))
    assert len(own.tokens) == params.max_tokens
    served = run(engine, short_q, params)
    assert engine.stats.finished.get("cached", 0) == 0, (
        f"the short question was served the long one's {len(cut.tokens)}-token answer, cut by its slot "
        f"({len(long_q)} + {params.max_tokens} > {MAX_LEN}): {len(served.tokens)} tokens, not its own 30"
    )
    assert served.tokens == own.tokens

    engine.responses.close()  # a complete answer is still kept, and served
    engine.responses = engine.new_tier()
    again = run(engine, short_q, params)
    text = TokenDecoder.from_model_dir(MODEL_DIR).delta
    assert engine.stats.finished.get("cached", 0) == 1
    assert again.tokens == own.tokens  # the ids its own run sent, as stored

    repeat = run(engine, long_q, params)  # the cut prompt itself: cut the same way, so the exact cache has it
    assert engine.stats.finished.get("cached", 0) == 2, "the exact cache lost a deterministic answer"
    assert text(repeat.tokens, 0, True) == text(cut.tokens, 0, True)


def test_a_full_answer_is_not_served_to_a_paraphrase_its_own_slot_would_cut(engine):
    """The other direction: a complete answer of a short question is more than a long paraphrase, cut by
    its slot, could ever produce; it computes (and the semantic cache is not asked)."""
    tokenizer = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    long_q = tokenizer.encode("What is the capital of France?" + "\n" * 20).ids
    short_q = tokenizer.encode("What is the capital of France?").ids
    params = EngineRequestParams(
        max_tokens=30, ignore_eos=True, stream=True, tenant=f"t{uuid.uuid4().hex[:6]}"
    )
    assert len(long_q) + params.max_tokens > MAX_LEN >= len(short_q) + params.max_tokens
    own_long = run(engine, long_q, replace(params, cache="kv-only"))
    assert len(own_long.tokens) < params.max_tokens
    assert len(run(engine, short_q, params).tokens) == params.max_tokens  # stored, complete
    engine.responses.close()
    engine.responses = engine.new_tier()
    served = run(engine, long_q, params)
    assert engine.stats.finished.get("cached", 0) == 0 and served.tokens == own_long.tokens
