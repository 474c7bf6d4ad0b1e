"""Streamed deltas over the engine's windows concatenate to the one-shot decode, for byte-level and
sentencepiece-style (ByteFallback, Metaspace) tokenizers, with and without stop-string trims."""

from __future__ import annotations

import json
import random
from collections.abc import Callable

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from engine.detokenize import CONTEXT_TOKENS, TokenDecoder, window_start
from engine.stop_strings import StopMatcher
from tests.test_detokenize import CORPUS, SPECIALS, train_byte_fallback, train_byte_level


def with_byte_tokens(tok: Tokenizer) -> Tokenizer:
    """The tokenizer with the 256 <0xNN> tokens appended to its vocabulary as ordinary tokens."""
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    return Tokenizer.from_str(json.dumps(spec))


def train_metaspace(byte_fallback: bool) -> Tokenizer:
    """Metaspace pre-tokenizer and decoder (drops the first token's U+2581), after ByteFallback or alone:
    alone, a <0xNN> token is no byte, just the 6 characters of its name."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=byte_fallback))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = (
        decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
        if byte_fallback
        else decoders.Metaspace()
    )
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False)
    tok.train_from_iterator([t for t in CORPUS if "漢" not in t], trainer)
    return with_byte_tokens(tok)


KINDS: dict[str, Callable[[], Tokenizer]] = {
    "byte_level": train_byte_level,
    "llama_byte_fallback": train_byte_fallback,
    "metaspace_byte_fallback": lambda: train_metaspace(True),
    "metaspace_only": lambda: train_metaspace(False),
}


@pytest.fixture(scope="module", params=list(KINDS))
def kind(request: pytest.FixtureRequest) -> tuple[Tokenizer, TokenDecoder]:
    tok = KINDS[request.param]()
    return tok, TokenDecoder.from_tokenizer(tok)


@pytest.fixture(scope="module")
def llama() -> tuple[Tokenizer, TokenDecoder]:
    tok = train_byte_fallback()
    return tok, TokenDecoder.from_tokenizer(tok)


def engine_stream(
    dec: TokenDecoder, ids: list[int], cuts: set[int], stops: tuple[str, ...] = ()
) -> tuple[list[bytes], bytes]:
    """(pieces, one-shot text) as the engine streams `ids` (Engine._accept_token/_emit): a response
    after each token index in `cuts` that releases something, then the final one; the one-shot text is
    the non-streamed response's (one window from 0, the same trim)."""
    token_bytes = lambda t: dec.raw_bytes([t])  # noqa: E731 (the engine's, as engine/loader.py builds it)
    stop, output, sent, pieces = StopMatcher(stops), [], 0, []
    for i, token in enumerate(ids):
        output.append(token)
        if stop.push(token_bytes(token)):
            break
        ready, trim = stop.releasable(finished=False)
        if i in cuts and ready > sent:
            start = window_start(output, sent, token_bytes, dec.byte_ids)
            pieces.append(dec.delta(output[start:ready], sent - start, False, trim))
            sent = ready
    ready, trim = stop.releasable(finished=True)
    start = window_start(output, sent, token_bytes, dec.byte_ids)
    pieces.append(dec.delta(output[start:ready], sent - start, True, trim))
    return pieces, dec.delta(output[:ready], 0, True, trim)


def random_ids(tok: Tokenizer, rng: random.Random, size: int) -> list[int]:
    """Ids of any kind, of byte tokens only, or of byte and special tokens mixed with the rest."""
    vocab = tok.get_vocab_size()
    byte_ids = [i for i in (tok.token_to_id(f"<0x{b:02X}>") for b in range(256)) if i is not None]
    byte_ids = byte_ids or [i for i in range(vocab) if len(tok.id_to_token(i)) == 1]
    special = [tok.token_to_id(s) for s in SPECIALS]
    pool = rng.choice(["any", "bytes", "mixed"])
    ids = []
    for _ in range(size):
        r = rng.random()
        if pool == "bytes" or (pool == "mixed" and r < 0.5):
            ids.append(rng.choice(byte_ids))
        elif pool == "mixed" and r < 0.65:
            ids.append(rng.choice(special))
        else:
            ids.append(rng.randrange(vocab))
    return ids


@pytest.mark.parametrize("seed", range(4))
def test_random_stream_equals_one_shot_decode(kind: tuple[Tokenizer, TokenDecoder], seed: int) -> None:
    """Property test (fixed seeds): random ids, random split points, with and without a stop string
    (a piece of the output's own text, so it often matches and trims the final response)."""
    tok, dec = kind
    rng = random.Random(seed)
    for _ in range(250):
        ids = random_ids(tok, rng, rng.randint(0, 30))
        cuts = {i for i in range(len(ids)) if rng.random() < rng.choice([0.2, 0.6, 1.0])}
        stops: tuple[str, ...] = ()
        text = dec.decode(ids)
        if text and rng.random() < 0.5:
            at = rng.randrange(len(text))
            stops = (text[at : at + rng.randint(1, 3)],)
        pieces, whole = engine_stream(dec, ids, cuts, stops)
        for piece in pieces:
            piece.decode("utf-8")  # every piece is valid UTF-8
        assert b"".join(pieces) == whole, (ids, sorted(cuts), stops)
        if not stops:
            assert whole.decode("utf-8") == tok.decode(ids, skip_special_tokens=True)


def test_output_starting_with_a_continuation_byte(llama: tuple[Tokenizer, TokenDecoder]) -> None:
    """The window at the output's beginning starts on <0x80>: a one-shot decode shows its U+FFFD and,
    the first token being that one, keeps the space of the next; the stream lost both."""
    tok, dec = llama
    ids = [tok.token_to_id("<0x80>"), *tok.encode("a café", add_special_tokens=False).ids]
    assert tok.decode(ids) == "\ufffd a café"
    pieces, whole = engine_stream(dec, ids, set(range(len(ids))))
    assert b"".join(pieces).decode() == whole.decode() == "\ufffd a café"


def test_byte_run_is_held_until_it_is_closed(llama: tuple[Tokenizer, TokenDecoder]) -> None:
    """ByteFallback decodes a run all or nothing: "!" (<0x21>) alone is text, but a later invalid byte
    of the same run makes the whole run U+FFFD, so "!" is not sent until a non-byte token closes it."""
    tok, dec = llama
    bang, lead = tok.token_to_id("<0x21>"), tok.token_to_id("<0xC9>")
    assert tok.decode([bang, lead]) == "\ufffd\ufffd"
    assert dec.delta([bang], 0, final=False) == b""
    assert dec.delta([bang, lead], 1, final=True) == "\ufffd\ufffd".encode()
    closed = [bang, *tok.encode("a", add_special_tokens=False).ids]
    assert dec.delta(closed, 0, final=False) == tok.decode(closed).encode()


def test_mid_output_context_of_special_tokens_keeps_the_space(llama: tuple[Tokenizer, TokenDecoder]) -> None:
    """A window cut after 4 special tokens decoded its first new token as the text's first, whose
    leading space sentencepiece decoders drop: "a b" streamed as "ab"."""
    tok, dec = llama
    a, b = (tok.encode(w, add_special_tokens=False).ids for w in ("a", "b"))
    pad = tok.token_to_id("<pad>")
    ids = [*a, *[pad] * CONTEXT_TOKENS, *b]
    pieces, whole = engine_stream(dec, ids, set(range(len(ids))))
    assert b"".join(pieces).decode() == whole.decode() == "a b"


def test_window_start_skips_back_to_a_token_of_two_bytes() -> None:
    sizes = [3, 1, 0, 1, 1, 1, 2, 1, 1, 1, 1]
    token_bytes = [b"x" * n for n in sizes]
    assert window_start(list(range(len(sizes))), 0, token_bytes.__getitem__) == 0
    assert window_start(list(range(len(sizes))), 3, token_bytes.__getitem__) == 0
    assert window_start(list(range(len(sizes))), 10, token_bytes.__getitem__) == 6  # 10 - 4 = 6: 2 bytes
    assert window_start(list(range(len(sizes))), 11, token_bytes.__getitem__) == 6
    assert window_start(list(range(len(sizes))), 9, token_bytes.__getitem__) == 0  # 5, 4, 3, 2, 1: short


def test_without_byte_fallback_byte_named_tokens_are_text() -> None:
    """A Metaspace-only decoder prints <0xB4> as its name: it is neither a byte for stop strings nor a
    byte run to hold back (the stream dropped it and the space after it)."""
    tok = train_metaspace(byte_fallback=False)
    dec = TokenDecoder.from_tokenizer(tok)
    name = tok.token_to_id("<0xB4>")
    assert dec.raw_bytes([name]) == b"<0xB4>" and not dec.byte_ids
    ids = [name, *tok.encode("a café", add_special_tokens=False).ids]
    pieces, whole = engine_stream(dec, ids, set(range(len(ids))))
    assert b"".join(pieces).decode() == whole.decode() == tok.decode(ids) == "<0xB4> a café"


def test_text_trim_never_splits_a_character(llama: tuple[Tokenizer, TokenDecoder]) -> None:
    """The trim counts per-token bytes; on decoded text that differs (U+FFFD for an invalid byte), a
    cut inside a character is replaced, never sent as invalid UTF-8."""
    tok, dec = llama
    ids = [*tok.encode("a", add_special_tokens=False).ids, tok.token_to_id("<0xC9>")]
    assert dec.delta(ids, 0, final=True) == "a\ufffd".encode()
    assert dec.delta(ids, 0, final=True, trim_bytes=1) == "a\ufffd".encode()  # a\xef\xbf: sanitized


def test_engine_streams_windows_from_window_start() -> None:
    """The engine cuts its streamed windows where `window_start` says: on a token of 2+ bytes."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from engine.engine import Engine
    from engine.model_runner import ModelRunner
    from engine.requests import EngineRequest
    from scheduler.messages import EngineRequestParams

    class Sink:
        def __init__(self) -> None:
            self.windows: list[tuple[list[int], int, bool]] = []

        def send(self, token_ids, read_offset, final, trim_bytes=0):
            self.windows.append((list(token_ids), read_offset, final))

        def fail(self, code, message):
            raise AssertionError(f"{code}: {message}")

        def cancelled(self):
            return False

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, max_position_embeddings=128, eos_token_id=2,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval()
    buckets = (8, 16, 32, 64)
    sizes = {t: 2 if t % 7 == 0 else t % 2 for t in range(300)}  # mostly 0- and 1-byte tokens
    token_bytes = lambda t: b"x" * sizes[t]  # noqa: E731
    engine = Engine(ModelRunner(model, slots=2, max_len=128, kv_buckets=buckets), token_bytes, {2}, buckets)
    sink = Sink()
    params = EngineRequestParams(max_tokens=40, ignore_eos=True, stream=True)
    engine.submit(EngineRequest("r", [1, 5, 9], params, 3, 0, sink))
    for _ in range(500):
        if not engine.step():
            break
    output: list[int] = []
    assert sink.windows and sink.windows[-1][2]
    for window, offset, _ in sink.windows:
        start = len(output) - offset
        assert window[:offset] == output[start:], "the context is the output already sent"
        assert start == window_start(output, len(output), token_bytes)
        output += window[offset:]
    assert len(output) == 40
