"""Found in review (detokenizer step): streamed pieces over the engine's windows must concatenate to the
one-shot text where the window's look-back bound used to cut a byte run or leave under 3 bytes of context."""

from __future__ import annotations

import pytest

from engine.detokenize import CONTEXT_TOKENS, MAX_EXTRA_CONTEXT, TokenDecoder, window_start
from tests.test_detokenize import SPECIALS, train_byte_fallback, train_byte_level
from tests.test_detokenize_windows import engine_stream, train_metaspace


@pytest.mark.parametrize(
    "make", [train_byte_fallback, lambda: train_metaspace(True)], ids=["llama", "metaspace"]
)
def test_long_byte_fallback_run_of_valid_text_is_streamed_whole(make) -> None:
    """25 characters the vocabulary lacks are 75 <0xNN> tokens in a row: the window's look-back stopped
    64 tokens back, inside the run, so the stream sent 68 U+FFFD where the one-shot text has the 25."""
    tok = make()
    dec = TokenDecoder.from_tokenizer(tok)
    text = "the cat " + "\ua66e" * 25 + " sat"
    ids = tok.encode(text, add_special_tokens=False).ids
    assert sum(i in dec.byte_ids for i in ids) > CONTEXT_TOKENS + MAX_EXTRA_CONTEXT
    pieces, whole = engine_stream(dec, ids, set(range(len(ids))))
    assert whole.decode() == text
    assert b"".join(pieces).decode() == text


def test_byte_level_context_of_two_continuation_bytes_then_specials() -> None:
    """A window whose first token (2+ bytes) is all continuation bytes, then 3 special tokens: its
    context holds 2 bytes, too few to see the lead byte before them, so the held-back F0 99 82 was
    never sent and the last byte came out alone as U+FFFD (U+19080 lost)."""
    tok = train_byte_level()
    dec = TokenDecoder.from_tokenizer(tok)
    pair = next(i for i, b in enumerate(dec.id_bytes) if b == b"\x99\x82")
    single = {b[0]: i for i, b in enumerate(dec.id_bytes) if len(b) == 1}
    special = tok.token_to_id(SPECIALS[0])
    ids = [single[0xF0], pair, special, special, special, single[0x80]]
    pieces, whole = engine_stream(dec, ids, set(range(len(ids))))
    assert whole.decode() == "\U00019080"
    assert b"".join(pieces).decode() == "\U00019080"


def test_look_back_over_special_tokens_stays_bounded() -> None:
    """The bound is kept where it costs nothing in correctness: a run of special tokens (b"")."""
    sizes = [2] + [0] * 500
    token_bytes = [b"x" * n for n in sizes]
    start = window_start(list(range(len(sizes))), 500, token_bytes.__getitem__)
    assert start >= 500 - CONTEXT_TOKENS - MAX_EXTRA_CONTEXT - 1


def test_look_back_over_other_single_byte_tokens_stays_bounded() -> None:
    """A long number is a 1-byte token per digit: whole characters, where a window may start, so the
    look-back past them keeps its bound (else every step of such an output re-sent the whole number);
    only ByteFallback's <0xNN> tokens (`byte_run`), which it decodes a run at a time, are followed back."""
    sizes = [2] + [1] * 500
    token_bytes = [b"x" * n for n in sizes]
    start = window_start(list(range(len(sizes))), 500, token_bytes.__getitem__)
    assert start >= 500 - CONTEXT_TOKENS - MAX_EXTRA_CONTEXT - 1
    assert window_start(list(range(len(sizes))), 500, token_bytes.__getitem__, range(1, 501)) == 0


@pytest.mark.parametrize(
    "text",
    [
        "\ua66e" * 30 + "\n" + "\ua66e" * 30,  # runs of bytes around a newline (itself a byte token in Llama)
        "ok " + "\U0001f600" * 20 + " done",  # 80 byte tokens of emoji
        "1234567890" * 10 + "\ua66e" * 25 + "0987654321" * 10,  # digit runs (bounded) around a byte run
    ],
)
def test_valid_text_of_long_byte_runs_streams_as_its_one_shot_decode(text) -> None:
    tok = train_byte_fallback()
    dec = TokenDecoder.from_tokenizer(tok)
    ids = tok.encode(text, add_special_tokens=False).ids
    for cuts in (set(range(len(ids))), set(range(0, len(ids), 7))):
        pieces, whole = engine_stream(dec, ids, cuts)
        assert whole.decode() == text and b"".join(pieces).decode() == text
