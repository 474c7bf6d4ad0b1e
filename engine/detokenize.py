"""Stateless incremental detokenization for streaming (pipeline step 3).

Each engine response carries a window of token ids and `read_offset`, the index where the new tokens
start. Byte-level BPE splits multi-byte UTF-8 characters across tokens, so decoding the new tokens
alone would emit broken characters; instead we emit exactly the bytes that the new tokens complete and
hold back a trailing incomplete character until a later response (or the final one) completes it.
Being stateless, any detokenizer instance can serve any response.

Consistency across calls: the delta's start depends only on the last 3 bytes of the window's context
(the tokens before `read_offset`). The engine's windows (`window_start`) start at least 4 tokens before
`read_offset` (or at 0), and further back past tokens of fewer than 2 bytes and until the context holds
3 bytes, which covers them even where the context is mostly special tokens (they decode to nothing).

Other tokenizers (sentencepiece: ByteFallback, Metaspace, Strip) are decoded as text, and a window is
decoded as if it began the output: the engine starts a window cut mid-output on a token of 2+ bytes
(never a byte-fallback or special token), so a cut never splits a byte run and the window's first
token, whose leading space such decoders drop, is always context, decoded alike in both texts diffed.

Runs in the numpy<2 text environment, which cannot import transformers: only `tokenizers` is used.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from tokenizers import Tokenizer

REPLACEMENT = "\ufffd"
CONTEXT_TOKENS = 4  # a UTF-8 character spans at most 4 byte-level tokens
CONTEXT_BYTES = 3  # a byte-level delta's start depends on the context's last 3 bytes
MAX_EXTRA_CONTEXT = 64  # how many short tokens but byte-fallback ones `window_start` looks back past


def _unicode_to_bytes() -> Mapping[str, int]:
    """Inverse of GPT-2's `bytes_to_unicode`: the printable stand-in character of each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return MappingProxyType(table)


UNICODE_TO_BYTES: Mapping[str, int] = _unicode_to_bytes()


def token_bytes(token: str, table: Mapping[str, int] = UNICODE_TO_BYTES) -> bytes:
    """Raw bytes of one byte-level token; tokens outside the table (added tokens) are their UTF-8,
    as tokenizers' ByteLevel decoder does."""
    try:
        return bytes(table[ch] for ch in token)
    except KeyError:
        return token.encode("utf-8")


def _needed_continuations(lead: int) -> int:
    if 0xC2 <= lead <= 0xDF:
        return 1
    if 0xE0 <= lead <= 0xEF:
        return 2
    if 0xF0 <= lead <= 0xF4:
        return 3
    return -1  # ASCII, continuation byte, or a byte that never starts a valid sequence


def _valid_second(lead: int, second: int) -> bool:
    low, high = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}.get(
        lead, (0x80, 0xBF)
    )
    return low <= second <= high


def complete_prefix_len(data: bytes | bytearray) -> int:
    """len(data) minus a trailing incomplete-but-so-far-valid UTF-8 sequence (at most 3 bytes).

    Invalid trailing bytes are not held back: no later byte can make them valid.
    """
    n = len(data)
    for start in range(n - 1, max(n - 4, -1), -1):
        lead = data[start]
        if 0x80 <= lead <= 0xBF:
            continue  # continuation byte: keep looking for its lead
        need = _needed_continuations(lead)
        have = n - start - 1
        if need <= have:
            return n  # ASCII, complete sequence, or invalid lead
        tail = data[start + 1 :]
        if tail and not _valid_second(lead, tail[0]):
            return n
        if any(not 0x80 <= b <= 0xBF for b in tail):
            return n
        return start
    return n


def sanitize(data: bytes | bytearray) -> bytes:
    """Valid UTF-8: invalid sequences become U+FFFD (maximal subparts, like Rust's from_utf8_lossy)."""
    return bytes(data).decode("utf-8", errors="replace").encode("utf-8")


def window_start(
    output: Sequence[int],
    sent: int,
    token_bytes: Callable[[int], bytes],
    byte_run: Collection[int] = frozenset(),
) -> int:
    """Where the engine's streamed window over `output` starts when `output[:sent]` has been sent.

    At least CONTEXT_TOKENS before `sent` (or 0), then back to a token of 2+ bytes: never a special
    token (b""), a byte-fallback token (1 byte) or, conservatively, any other 1-byte token, so a
    text-diff decode never sees a byte run cut by the window start, nor a new token as the window's first
    decoded one (see the module doc); and back until the context holds CONTEXT_BYTES, which a byte-level
    delta needs (a first token of 2 continuation bytes then special tokens held fewer). It looks back
    past at most MAX_EXTRA_CONTEXT special and other short tokens (a long number is a digit token
    each), but past `byte_run` tokens (ByteFallback's <0xNN>: `TokenDecoder.byte_ids`) without a
    bound: ByteFallback decodes a run all or nothing, and a bound inside a run of 65+ of them (25
    characters outside the vocabulary) sent U+FFFD for valid text. The window grows with such a run
    only, whose text is held until its last character completes anyway.
    """
    start = max(0, sent - CONTEXT_TOKENS)
    context = sum(len(token_bytes(t)) for t in output[start + 1 : sent])  # output[start:sent] once added
    extra = 0
    while start > 0:
        size = len(token_bytes(output[start]))
        context += size
        if size >= 2 and context >= CONTEXT_BYTES:
            break
        if output[start] not in byte_run:
            extra += 1
            if extra > MAX_EXTRA_CONTEXT:
                break
        start -= 1
    return start


def _decoder_types(tokenizer: Tokenizer) -> list[str]:
    """Types of the tokenizer's decoder, a Sequence's parts in order (empty without a decoder)."""
    decoder = json.loads(tokenizer.to_str()).get("decoder") or {}
    if decoder.get("type") == "Sequence":
        return [str(d.get("type")) for d in decoder.get("decoders") or []]
    return [str(decoder["type"])] if decoder.get("type") else []


def _is_byte_level(tokenizer: Tokenizer) -> bool:
    types = _decoder_types(tokenizer)
    return bool(types) and all(t == "ByteLevel" for t in types)


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _approx_token_bytes(token: str, byte_fallback: bool = True) -> bytes:
    """Bytes of one token of a non-byte-level tokenizer, for per-token consumers (stop strings):
    <0xNN> is its byte where the decoder has ByteFallback (else it decodes as its 6 characters),
    sentencepiece's U+2581 marker is a space."""
    match = _BYTE_FALLBACK.fullmatch(token) if byte_fallback else None
    if match:
        return bytes([int(match.group(1), 16)])
    return token.replace("\u2581", " ").encode("utf-8")


@dataclass(frozen=True, eq=False)
class TokenDecoder:
    """Turns (window, read_offset) into the UTF-8 bytes the new tokens complete.

    Byte-level tokenizers are decoded through `id_bytes` (raw bytes per id, b"" for special tokens);
    other tokenizers fall back to diffing `Tokenizer.decode` text, and their `id_bytes` is only an
    approximation for per-token consumers such as stop-string matching.
    """

    tokenizer: Tokenizer
    id_bytes: tuple[bytes, ...]
    byte_level: bool
    byte_ids: frozenset[int] = frozenset()  # ByteFallback's <0xNN> tokens (text-diff decoding only)

    @classmethod
    def from_model_dir(cls, path: str | Path) -> TokenDecoder:
        return cls.from_tokenizer(Tokenizer.from_file(str(Path(path) / "tokenizer.json")))

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer) -> TokenDecoder:
        byte_level = _is_byte_level(tokenizer)
        byte_fallback = not byte_level and "ByteFallback" in _decoder_types(tokenizer)
        special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        id_bytes = [b""] * (max(vocab.values(), default=-1) + 1)
        for token, idx in vocab.items():
            if idx in special:
                continue
            id_bytes[idx] = token_bytes(token) if byte_level else _approx_token_bytes(token, byte_fallback)
        # ByteFallback decodes a run of <0xNN> tokens all or nothing: the text diff holds runs back
        byte_ids = frozenset()
        if byte_fallback:
            ids = (tokenizer.token_to_id(f"<0x{b:02X}>") for b in range(256))
            byte_ids = frozenset(i for i in ids if i is not None and i not in special)
        return cls(tokenizer, tuple(id_bytes), byte_level, byte_ids)

    def raw_bytes(self, token_ids: Sequence[int]) -> bytes:
        """Concatenated bytes of the tokens (exact for byte-level tokenizers); special and unknown ids
        contribute nothing, as in `Tokenizer.decode`."""
        table = self.id_bytes
        size = len(table)
        return b"".join(table[i] if 0 <= i < size else b"" for i in map(int, token_ids))

    def decode(self, token_ids: Sequence[int]) -> str:
        """Full decode without special tokens; what all deltas of a stream concatenate to."""
        if self.byte_level:
            return self.raw_bytes(token_ids).decode("utf-8", errors="replace")
        return self.tokenizer.decode([int(i) for i in token_ids], skip_special_tokens=True)

    def delta(self, token_ids: Sequence[int], read_offset: int, final: bool, trim_bytes: int = 0) -> bytes:
        """UTF-8 bytes completed by token_ids[read_offset:], given token_ids[:read_offset] as context.

        `trim_bytes` (final only) drops the end of the text where a stop string began mid-token.
        """
        if not 0 <= read_offset <= len(token_ids):
            raise ValueError(f"read_offset {read_offset} is outside the window of {len(token_ids)} tokens")
        if trim_bytes < 0 or (trim_bytes and not final):
            raise ValueError(f"trim_bytes={trim_bytes}: allowed only on the final response, and >= 0")
        if self.byte_level:
            prefix = self.raw_bytes(token_ids[:read_offset])
            full = prefix + self.raw_bytes(token_ids[read_offset:])
            end = len(full) - trim_bytes if final else complete_prefix_len(full)
            return sanitize(full[complete_prefix_len(prefix) : max(end, complete_prefix_len(prefix))])
        if any(not 0 <= int(i) < 2**32 for i in token_ids):  # Tokenizer.decode raised OverflowError: INTERNAL
            raise ValueError(f"token ids must lie in 0..2**32-1 (got {min(token_ids)}..{max(token_ids)})")
        text = self._text_delta(token_ids, read_offset, final)
        # the trim counts `id_bytes`, which may differ from the decoded text (U+FFFD): never split a character
        return sanitize(text[: max(0, len(text) - trim_bytes)]) if trim_bytes else text

    def _text_delta(self, token_ids: Sequence[int], read_offset: int, final: bool) -> bytes:
        """Fallback for non-byte-level tokenizers: diff decoded text.

        ByteFallback decodes a run of <0xNN> tokens all or nothing (one invalid byte turns the whole
        run, complete characters included, into U+FFFD per byte), and a decode that ends in U+FFFD may
        be a character still being completed. So the text counted as sent through token k is the decode
        of the longest prefix ids[:j], j <= k, that ends in a token closing any byte run (shown, not a
        byte token) and does not end in U+FFFD; that is recomputable from the window alone, keeping
        this stateless. The window is decoded as the output's beginning: see the module doc.
        """
        ids = [int(i) for i in token_ids]
        sent = self._stable_text(ids, read_offset)
        if final:
            full = self.tokenizer.decode(ids, skip_special_tokens=True)
        else:
            full = self._stable_text(ids, len(ids))
        common = len(sent)
        if not full.startswith(sent):  # decoding changed earlier text; emit from where they diverge
            common = next(
                (i for i, (a, b) in enumerate(zip(sent, full)) if a != b), min(len(sent), len(full))
            )
        return full[common:].encode("utf-8")

    def _closes(self, token: int) -> bool:
        """A shown token that is no byte token: the byte run before it is decoded for good."""
        return 0 <= token < len(self.id_bytes) and bool(self.id_bytes[token]) and token not in self.byte_ids

    def _stable_text(self, ids: list[int], end: int) -> str:
        for j in range(end, 0, -1):
            if not self._closes(ids[j - 1]):
                continue
            text = self.tokenizer.decode(ids[:j], skip_special_tokens=True)
            if not text.endswith(REPLACEMENT):
                return text
        return ""
