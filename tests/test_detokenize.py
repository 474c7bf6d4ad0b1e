"""Incremental detokenization: deltas of a stream concatenate to the full decode, characters never split."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from engine.detokenize import (
    UNICODE_TO_BYTES,
    TokenDecoder,
    complete_prefix_len,
    sanitize,
    token_bytes,
    window_start,
)

SPECIALS = ["<s>", "</s>", "<pad>", "<unk>"]
CORPUS = [
    "The café serves crème brûlée and naïve piña coladas.",
    "漢字とかなを混ぜた日本語の文章です。東京は大きい都市です。",
    "Emoji time: 🙂🙂 🚀 launch, 👍🏽 thumbs, 🇫🇷 flag, family 👨‍👩‍👧.",
    "Ελληνικά και русский текст, עברית, العربية.",
    "def add(a, b):\n    return a + b  # plain ASCII code\n",
    "Mixed: naïve 漢字 🙂 café — “quotes” and ellipsis…",
] * 20
TEXTS = [
    "café 漢字 🙂",
    "🚀🚀🚀 launch",
    "naïve crème brûlée",
    "新しい漢字、未知の文字: 龘 𝄞 🦄",
    "plain ascii only",
    "👨‍👩‍👧 family and 🇫🇷",
]


def train_byte_level(vocab_size: int = 400) -> Tokenizer:
    """Same construction as engine/build_model.py, on a small in-test corpus."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    return tok


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return train_byte_level()


@pytest.fixture(scope="module")
def dec(tok: Tokenizer) -> TokenDecoder:
    return TokenDecoder.from_tokenizer(tok)


def stream(dec: TokenDecoder, ids: list[int], rng: random.Random) -> list[bytes]:
    """Split ids into random chunks and decode each as the engine would send it: a window starting where
    `window_start` puts it, for the tokens sent or (more context) up to 3 fewer."""
    pieces: list[bytes] = []
    sent = 0
    while sent < len(ids) or not pieces:
        end = min(len(ids), sent + rng.randint(1, 4))
        start = window_start(ids, max(0, sent - rng.randint(0, 3)), lambda t: dec.raw_bytes([t]))
        pieces.append(dec.delta(ids[start:end], sent - start, final=end == len(ids)))
        sent = end
    return pieces


def test_byte_table_inverts_gpt2_table() -> None:
    assert len(UNICODE_TO_BYTES) == 256
    assert sorted(UNICODE_TO_BYTES.values()) == list(range(256))
    assert token_bytes("Ġhello") == b" hello"
    assert token_bytes("Ċ") == b"\n"
    assert token_bytes("é x") == "é x".encode()  # not byte-level (added token): its UTF-8


def test_is_byte_level_and_specials_are_empty(tok: Tokenizer, dec: TokenDecoder) -> None:
    assert dec.byte_level
    for name in SPECIALS:
        assert dec.raw_bytes([tok.token_to_id(name)]) == b""
    assert dec.raw_bytes([10**9, -1]) == b""  # ids past the vocabulary decode to nothing, as in tokenizers


def test_multibyte_characters_are_split_across_tokens(tok: Tokenizer, dec: TokenDecoder) -> None:
    ids = tok.encode("龘 𝄞 🦄").ids
    prefixes = [dec.raw_bytes(ids[:k]) for k in range(len(ids))]
    assert any(complete_prefix_len(p) < len(p) for p in prefixes)


@pytest.mark.parametrize("text", TEXTS)
def test_full_decode_matches_tokenizers(tok: Tokenizer, dec: TokenDecoder, text: str) -> None:
    ids = tok.encode(text).ids
    assert ids[0] == tok.token_to_id("<s>")
    assert dec.decode(ids) == tok.decode(ids, skip_special_tokens=True) == text


def test_random_ids_decode_matches_tokenizers(tok: Tokenizer, dec: TokenDecoder) -> None:
    rng = random.Random(7)
    size = tok.get_vocab_size()
    for _ in range(300):
        ids = [rng.randrange(size) for _ in range(rng.randint(0, 30))]
        assert dec.decode(ids) == tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_pieces_are_whole_characters(tok: Tokenizer, dec: TokenDecoder, text: str) -> None:
    ids = tok.encode(text).ids
    last = len(ids) - 1
    pieces = [dec.delta(ids[max(0, i - 4) : i + 1], min(i, 4), final=i == last) for i in range(len(ids))]
    assert b"".join(pieces).decode("utf-8") == text
    assert "\ufffd" not in "".join(p.decode("utf-8") for p in pieces)  # no piece splits a character


def test_hold_back_then_complete() -> None:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        ["x"], trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, show_progress=False,
                                   initial_alphabet=pre_tokenizers.ByteLevel.alphabet()),
    )  # fmt: skip
    dec = TokenDecoder.from_tokenizer(tok)
    emoji = "🙂".encode()  # 4 bytes, one token each: nothing merges
    ids = [tok.token_to_id("a")] + tok.encode("🙂").ids
    assert len(ids) == 5
    assert dec.delta(ids[:2], 1, final=False) == b""  # lead byte only: held back
    assert dec.delta(ids[:4], 2, final=False) == b""  # still incomplete
    assert dec.delta(ids[:5], 4, final=False) == emoji  # the last byte completes it
    assert dec.delta(ids[:3], 1, final=True) == "\ufffd".encode()  # final flushes, sanitized
    assert dec.delta(ids[:1], 0, final=False) == b"a"


def test_complete_prefix_len_rules() -> None:
    assert complete_prefix_len(b"") == 0
    assert complete_prefix_len(b"ab") == 2
    assert complete_prefix_len("é".encode()[:1]) == 0
    assert complete_prefix_len(b"a" + "漢".encode()[:2]) == 1
    assert complete_prefix_len(b"a" + "🙂".encode()[:3]) == 1
    assert complete_prefix_len("🙂".encode()) == 4
    assert complete_prefix_len(b"a\xe0\x80") == 3  # invalid second byte: never completes, not held
    assert complete_prefix_len(b"a\xed\xa0") == 3  # surrogate range
    assert complete_prefix_len(b"a\xf5") == 2  # never a lead byte
    assert complete_prefix_len(b"\x80\x80\x80") == 3  # stray continuations
    assert complete_prefix_len(b"\xe2\x82\xf0\x9f") == 2  # only the last sequence is held
    assert sanitize(b"a\xff") == "a\ufffd".encode()


@pytest.mark.parametrize("seed", range(8))
def test_stream_of_encoded_text_concatenates_to_text(tok: Tokenizer, dec: TokenDecoder, seed: int) -> None:
    rng = random.Random(seed)
    for text in TEXTS:
        ids = tok.encode(text).ids
        assert b"".join(stream(dec, ids, rng)).decode("utf-8") == text


@pytest.mark.parametrize("seed", range(10))
def test_random_ids_stream_equals_full_decode(tok: Tokenizer, dec: TokenDecoder, seed: int) -> None:
    """Property test (fixed seeds): random ids, random split points, windows >= 4 tokens of context."""
    rng = random.Random(1000 + seed)
    special = {tok.token_to_id(s) for s in SPECIALS}
    ordinary = [i for i in range(tok.get_vocab_size()) if i not in special]
    short = [i for i in ordinary if len(dec.raw_bytes([i])) == 1]  # single bytes: many split characters
    for _ in range(100):
        pool = rng.choice([ordinary, short])
        ids = [rng.choice(pool) for _ in range(rng.randint(0, 40))]
        pieces = stream(dec, ids, rng)
        for piece in pieces:
            piece.decode("utf-8")  # every piece is valid UTF-8
        expected = tok.decode(ids, skip_special_tokens=True)
        assert b"".join(pieces).decode("utf-8") == dec.decode(ids) == expected


def test_random_ids_with_specials_from_window_start(tok: Tokenizer, dec: TokenDecoder) -> None:
    rng = random.Random(99)
    size = tok.get_vocab_size()
    for _ in range(200):
        n = rng.randint(1, 30)
        ids = [rng.randrange(size) if rng.random() < 0.8 else rng.randrange(len(SPECIALS)) for _ in range(n)]
        cuts = sorted(rng.sample(range(1, len(ids) + 1), k=min(len(ids), rng.randint(1, 5))))
        if cuts[-1] != len(ids):
            cuts.append(len(ids))
        pieces, sent = [], 0
        for end in cuts:
            pieces.append(dec.delta(ids[:end], sent, final=end == len(ids)))
            sent = end
        assert b"".join(pieces).decode("utf-8") == dec.decode(ids)


def test_read_offset_out_of_range(dec: TokenDecoder) -> None:
    with pytest.raises(ValueError, match="outside the window"):
        dec.delta([1, 2], 3, final=False)


def test_from_model_dir(tmp_path: Path, tok: Tokenizer) -> None:
    tok.save(str(tmp_path / "tokenizer.json"))
    loaded = TokenDecoder.from_model_dir(tmp_path)
    ids = tok.encode("café 🙂").ids
    assert loaded.byte_level and loaded.decode(ids) == "café 🙂"


def train_byte_fallback() -> Tokenizer:
    """A Llama-2-style sentencepiece BPE with byte fallback: not byte-level, uses the text-diff path."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False)
    tok.train_from_iterator([t for t in CORPUS if "漢" not in t], trainer)  # CJK only via byte fallback
    spec = json.loads(tok.to_str())  # append the <0xNN> byte tokens as ordinary (non-special) vocab
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    return Tokenizer.from_str(json.dumps(spec))


def test_fallback_text_diff_stream() -> None:
    tok = train_byte_fallback()
    dec = TokenDecoder.from_tokenizer(tok)
    assert not dec.byte_level
    rng = random.Random(3)
    for text in TEXTS:
        ids = tok.encode(text).ids
        assert tok.decode(ids) == text
        pieces = [dec.delta(ids[: i + 1], i, final=i == len(ids) - 1) for i in range(len(ids))]
        assert b"".join(pieces).decode("utf-8") == text
        assert "\ufffd" not in "".join(p.decode() for p in pieces)
        assert b"".join(stream(dec, ids, rng)).decode("utf-8") == text


def test_fallback_per_token_bytes_for_stop_strings() -> None:
    tok = train_byte_fallback()
    dec = TokenDecoder.from_tokenizer(tok)
    assert dec.raw_bytes([tok.token_to_id("<0xE6>")]) == b"\xe6"
    assert dec.raw_bytes([tok.token_to_id("<s>")]) == b""
    ids = tok.encode("café crème").ids
    assert dec.raw_bytes(ids) == " café crème".encode()  # sentencepiece marks the leading space


def test_trim_bytes_cuts_the_final_text_where_a_stop_string_began(tok: Tokenizer, dec: TokenDecoder) -> None:
    ids = tok.encode("hello world", add_special_tokens=False).ids
    assert dec.delta(ids, 0, final=True, trim_bytes=len(" world")) == b"hello"
    with pytest.raises(ValueError, match="final"):
        dec.delta(ids, 0, final=False, trim_bytes=1)
