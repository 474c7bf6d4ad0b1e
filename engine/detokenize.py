"""Stateless incremental detokenization for streaming (pipeline step 3).

Each engine response carries a window of token ids and `read_offset`, the index where the new tokens
start. Byte-level BPE splits multi-byte UTF-8 characters across tokens, so decoding the new tokens
alone would emit broken characters; instead we emit exactly the bytes that the new tokens complete and
hold back a trailing incomplete character until a later response (or the final one) completes it.
Being stateless, any detokenizer instance can serve any response.

Consistency across calls: the delta's start depends only on the last 3 bytes of the window's context
(the tokens before `read_offset`). The engine's windows start at least 4 tokens before `read_offset`
(or at 0), which covers them unless the context is mostly special tokens (they decode to nothing).

Runs in the numpy<2 text environment, which cannot import transformers: only `tokenizers` is used.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from tokenizers import Tokenizer

REPLACEMENT = "\ufffd"


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


def _is_byte_level(tokenizer: Tokenizer) -> bool:
    decoder = json.loads(tokenizer.to_str()).get("decoder") or {}
    if decoder.get("type") == "ByteLevel":
        return True
    if decoder.get("type") == "Sequence":
        parts = decoder.get("decoders") or []
        return bool(parts) and all(d.get("type") == "ByteLevel" for d in parts)
    return False


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _approx_token_bytes(token: str) -> bytes:
    """Bytes of one token of a non-byte-level tokenizer, for per-token consumers (stop strings):
    ByteFallback <0xNN> is its byte, sentencepiece's U+2581 marker is a space."""
    match = _BYTE_FALLBACK.fullmatch(token)
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
    continuation_ids: frozenset[int] = frozenset()

    @classmethod
    def from_model_dir(cls, path: str | Path) -> TokenDecoder:
        return cls.from_tokenizer(Tokenizer.from_file(str(Path(path) / "tokenizer.json")))

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer) -> TokenDecoder:
        byte_level = _is_byte_level(tokenizer)
        special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        id_bytes = [b""] * (max(vocab.values(), default=-1) + 1)
        for token, idx in vocab.items():
            if idx not in special:
                id_bytes[idx] = token_bytes(token) if byte_level else _approx_token_bytes(token)
        # ByteFallback tokens <0x80>..<0xBF> continue a character; a text-diff window must not start on one.
        continuation = frozenset()
        if not byte_level:
            ids = (tokenizer.token_to_id(f"<0x{b:02X}>") for b in range(0x80, 0xC0))
            continuation = frozenset(i for i in ids if i is not None)
        return cls(tokenizer, tuple(id_bytes), byte_level, continuation)

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
        text = self._text_delta(token_ids, read_offset, final)
        return text[: len(text) - trim_bytes] if trim_bytes else text

    def _text_delta(self, token_ids: Sequence[int], read_offset: int, final: bool) -> bytes:
        """Fallback for non-byte-level tokenizers: diff decoded text.

        A decode that ends in U+FFFD may be a byte-fallback character still being completed, and such
        decoders (ByteFallback) can even turn already-decoded characters before it into U+FFFD. So the
        text counted as sent through token k is the decode of the longest prefix ids[:j], j <= k, that
        does not end in U+FFFD; that is recomputable from the window alone, keeping this stateless.
        """
        start = 0  # skip a character cut by the window start: ByteFallback would turn its run into U+FFFD
        while start < read_offset and int(token_ids[start]) in self.continuation_ids:
            start += 1
        ids = [int(i) for i in token_ids[start:]]
        read_offset -= start
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

    def _stable_text(self, ids: list[int], end: int) -> str:
        for j in range(end, 0, -1):
            text = self.tokenizer.decode(ids[:j], skip_special_tokens=True)
            if not text.endswith(REPLACEMENT):
                return text
        return ""
