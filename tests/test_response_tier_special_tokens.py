"""The semantic cache compares prompts as the detokenizer's text of their ids, which drops special
tokens: prompts that spell "<s>", "</s>" or "<pad>" (an HTML question about the <s> tag) tokenize to
those special ids in the scheduler step, so two different questions become one text, share one semantic
entry (same entry id) and were served each other's answer at cosine 1.0. Found in review."""

from __future__ import annotations

import uuid
import pytest
from tokenizers import Tokenizer

from conftest import MODEL_DIR as MODEL
from engine.config import EngineConfig
from engine.detokenize import TokenDecoder
from engine.loader import build_response_tier
from scheduler.messages import EngineRequestParams


def semantic_tier_config(redis_url: str) -> EngineConfig:
    """The tiny model's response tier with the semantic cache on, every answer written at once."""
    return EngineConfig(
        model_dir=str(MODEL),
        redis_url=redis_url,
        response_cache_first_use=True,
        semantic_cache=True,
        redis_key_directory=False,
    )


@pytest.mark.parametrize(
    "template",
    [
        "What does the {} tag do in HTML?",
        "{} tag: what does it do in HTML?",  # at the start, right after the BOS (a second review)
    ],
)
def test_prompts_differing_only_in_a_special_token_spelling_do_not_share_a_semantic_answer(
    redis_server, template
):
    config = semantic_tier_config(redis_server)
    decoder = TokenDecoder.from_model_dir(MODEL)
    tier = build_response_tier(config, f"fp-{uuid.uuid4().hex[:8]}", MODEL, decoder, lambda m: None)
    assert tier is not None and tier.semantic is not None, "semantic cache must be on for this test"
    scheduler_tokenizer = Tokenizer.from_file(str(MODEL / "tokenizer.json"))  # as slo_scheduler's step
    params = EngineRequestParams(max_tokens=8, temperature=0.0, tenant=f"t{uuid.uuid4().hex[:6]}")

    strike = scheduler_tokenizer.encode(template.format("<s>")).ids
    pad = scheduler_tokenizer.encode(template.format("<pad>")).ids
    again = scheduler_tokenizer.encode(template.format("<s>") + " ").ids  # another wording, same tokens
    assert strike != pad  # the exact cache keeps them apart
    answer_ids = scheduler_tokenizer.encode(" It strikes text through.", add_special_tokens=False).ids

    (strike_text, strike_variant), (pad_text, pad_variant) = tier.prompt_text(strike), tier.prompt_text(pad)
    assert strike_text == pad_text and strike_variant != pad_variant  # the BOS is in neither variant
    tier.remember(strike, params, answer_ids, 0, final=True)
    tier.close()  # drains the writer
    tier2 = build_response_tier(config, tier.cache.fingerprint, MODEL, decoder, lambda m: None)
    try:
        found = tier2.lookup(pad, params)
        served = None if found.tokens is None else decoder.decode(found.tokens)
        assert found.tokens is None, (
            f"the <pad> question was served the <s> question's answer from the semantic cache: {served!r}"
        )
        assert tier2.lookup(again, params).tokens is not None  # the same special tokens still match
    finally:
        tier2.close()


def test_the_tokenizers_own_lead_is_not_part_of_a_prompts_variant():
    from engine.loader import added_lead

    tokenizer = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
    lead = added_lead(tokenizer)
    assert lead and tokenizer.encode("hello").ids[: len(lead)] == lead
    assert added_lead(Tokenizer.from_str(tokenizer.to_str())) == lead
