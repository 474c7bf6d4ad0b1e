"""A stop string that begins inside a token is trimmed by `trim_bytes`, counted in the tokens' raw bytes
(engine/stop_strings.py). The detokenizer trims the raw bytes, then replaces invalid UTF-8; the response
tier trimmed the already-sanitized text, whose length differs wherever an incomplete character became
U+FFFD (3 bytes for 1-3). So with a byte-level vocabulary holding partial-character tokens (GPT-2 and
Llama-3 have b" \\xe2\\x80", which begins ' “', ' —', ' ’') a hit served other text than generation sent.
Found in review."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from engine.config import EngineConfig
from engine.detokenize import TokenDecoder, UNICODE_TO_BYTES
from engine.loader import build_response_tier
from engine.stop_strings import StopMatcher
from scheduler.messages import EngineRequestParams

BYTE_TO_CHAR = {b: ch for ch, b in UNICODE_TO_BYTES.items()}


def gpt2_like_tokenizer() -> Tokenizer:
    """Byte-level BPE with the merge GPT-2 and Llama-3 both have: b' \\xe2\\x80'
    (' “' = [' \\xe2\\x80', '\\x9c'])."""
    alphabet = [BYTE_TO_CHAR[b] for b in range(256)]
    sp, e2, x80 = BYTE_TO_CHAR[0x20], BYTE_TO_CHAR[0xE2], BYTE_TO_CHAR[0x80]
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab[sp + e2] = len(vocab)
    vocab[sp + e2 + x80] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[(sp, e2), (sp + e2, x80)]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    gpt2_like_tokenizer().save(str(tmp_path / "tokenizer.json"))
    return tmp_path


def engine_finish(
    decoder: TokenDecoder, output: list[int], stop: tuple[str, ...]
) -> tuple[list[int], int, int]:
    """What Engine._accept_token/_emit compute on the final response: (the tokens generated up to the
    one that completed the stop string, ready tokens, trim bytes)."""
    matcher = StopMatcher(stop)
    for count, token in enumerate(output, 1):
        if matcher.push(decoder.raw_bytes([token])):
            break
    else:
        raise AssertionError("the stop string never matched")
    ready, trim = matcher.releasable(finished=True)
    return output[:count], ready, trim


def test_a_cached_answer_trimmed_at_a_stop_string_is_what_generation_sent(redis_server, model_dir):
    decoder = TokenDecoder.from_model_dir(model_dir)
    assert decoder.byte_level
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    output = tokenizer.encode("He said “hi”", add_special_tokens=False).ids
    assert [decoder.raw_bytes([t]) for t in output[7:9]] == [b" \xe2\x80", b"\x9c"]  # ' “' is 2 tokens
    params = EngineRequestParams(
        max_tokens=32, temperature=0.0, stop=("“",), exclude_input_in_output=True, tenant="trim"
    )
    generated, ready, trim = engine_finish(decoder, output, params.stop)
    assert trim == 2  # the stop string begins inside ' \xe2\x80'
    # the miss: Engine._emit sends output[:ready] (exclude_input_in_output) with trim, the detokenizer decodes
    sent = decoder.delta(output[:ready], 0, True, trim).decode("utf-8")
    assert sent == "He said "

    config = EngineConfig(
        model_dir=str(model_dir),
        redis_url=redis_server,
        response_cache_first_use=True,
        redis_key_directory=False,
    )
    fingerprint = f"fp-{uuid.uuid4().hex[:8]}"
    prompt = [5, 6, 7]
    tier = build_response_tier(config, fingerprint, model_dir, decoder, lambda m: None)
    tier.remember(prompt, params, generated, trim, final=True, sent=ready)  # Engine._emit's call
    tier.close()
    tier = build_response_tier(config, fingerprint, model_dir, decoder, lambda m: None)
    try:
        found = tier.lookup(prompt, params)
        assert found.tokens is not None, "the answer was cached"
        # the hit: Engine._answer_from_cache sends the stored ids as one final window, with their trim
        served = decoder.delta(found.tokens, 0, True, found.trim).decode("utf-8")
        assert served == sent, f"a hit served {served!r}; generation sent {sent!r}"
    finally:
        tier.close()
