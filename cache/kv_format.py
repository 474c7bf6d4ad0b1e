"""A safe, versioned binary format for one KV block (one Redis value, L3).

KV snapshots are prompt-equivalent data read back from a shared store, so a value is never trusted:
no pickle and no `torch.load` (both execute code), every length is checked against the bytes present,
a checksum covers everything before it, and the stored meta must match what the reader expects.

Layout (all integers little-endian)::

    magic b"TWKV" | version u16 | header_len u32 | header (JSON, UTF-8) | payload | BLAKE2b-128 (16 B)

The header holds the block's meta, the block key it was written for (hex), the payload length, the raw
(uncompressed) length, the compression ("none" or "zlib"), the checksum algorithm and the byte order.
The block key binds a value to its name: a value copied under another block's name (a restore of the
wrong snapshot, a manual COPY) is intact but not that block's KV, and another tenant's at worst; the
reader refuses it (version 2; version 1 values named no block). The payload is the tensor's
contiguous CPU bytes (read through a uint8 view, so bfloat16 needs no numpy bf16), optionally
zlib-compressed at level 1. The checksum is over magic, version, header length, header and payload.
Invariant for later versions: the same prefix and a 16-byte BLAKE2b trailer, so a reader can tell a
damaged value (CorruptValue) from a genuine value of an unknown version (IncompatibleValue).
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import sys
import zlib
from dataclasses import dataclass
from typing import Any

import torch

MAGIC = b"TWKV"
FORMAT_VERSION = 2
CHECKSUM_ALGORITHM = "blake2b-128"
_PREFIX = struct.Struct("<4sHI")  # magic, version, header length
_DIGEST_SIZE = 16
_MAX_HEADER = 64 * 1024  # a real header is a few hundred bytes; more means a damaged length field
_COMPRESSIONS = ("none", "zlib")

# Allowed dtypes by name: a closed list, so a value can never make the reader resolve arbitrary names.
_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
}
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        _DTYPES[_name] = getattr(torch, _name)


class KVFormatError(ValueError):
    """A stored KV value cannot be used."""


class CorruptValue(KVFormatError):
    """Damaged bytes: bad magic, lengths (truncation), checksum, or an undecodable header/payload."""


class IncompatibleValue(KVFormatError):
    """An intact value written for another model, dtype, shape, layout or format version."""


@dataclass(frozen=True)
class KVBlockMeta:
    model_fingerprint: str
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    shape: tuple[int, ...]
    token_count: int
    layout: str  # e.g. "L2HBD-v1": [layers, 2 (k/v), kv_heads, block tokens, head_dim]

    def to_json(self) -> dict[str, Any]:
        return {
            "model_fingerprint": self.model_fingerprint,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "token_count": self.token_count,
            "layout": self.layout,
        }

    @classmethod
    def from_json(cls, obj: Any) -> KVBlockMeta:
        """Strictly typed: anything unexpected is a CorruptValue, never a TypeError later."""
        if not isinstance(obj, dict):
            raise CorruptValue("header 'meta' is not an object")
        fp, dtype, shape, tokens, layout = (
            obj.get(k) for k in ("model_fingerprint", "dtype", "shape", "token_count", "layout")
        )
        if not (isinstance(fp, str) and isinstance(dtype, str) and isinstance(layout, str)):
            raise CorruptValue("header meta: model_fingerprint, dtype and layout must be strings")
        if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
            raise CorruptValue(f"header meta: shape must be a list of non-negative ints, got {shape!r}")
        if not _is_count(tokens):
            raise CorruptValue(f"header meta: token_count must be a non-negative int, got {tokens!r}")
        return cls(fp, dtype, tuple(shape), tokens, layout)


def _is_count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _digest(data: bytes | memoryview) -> bytes:
    return hashlib.blake2b(data, digest_size=_DIGEST_SIZE).digest()


def encode_block(
    tensor: torch.Tensor, meta: KVBlockMeta, compress: bool = False, block: bytes = b""
) -> bytes:
    """One self-contained value for `tensor`, bound to the block key `block` (what `decode_block` must be
    given back); raises ValueError if `meta` does not describe it."""
    if meta.dtype not in _DTYPES:
        raise ValueError(f"dtype {meta.dtype!r} is not supported; allowed: {sorted(_DTYPES)}")
    if tensor.dtype != _DTYPES[meta.dtype]:
        raise ValueError(f"tensor dtype {dtype_name(tensor.dtype)} does not match meta dtype {meta.dtype}")
    if tuple(tensor.shape) != tuple(meta.shape):
        raise ValueError(f"tensor shape {tuple(tensor.shape)} does not match meta shape {meta.shape}")
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    raw = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    payload = zlib.compress(raw, 1) if compress else raw
    header = json.dumps(
        {
            "meta": meta.to_json(),
            "block": block.hex(),
            "payload_bytes": len(payload),
            "raw_bytes": len(raw),
            "compression": "zlib" if compress else "none",
            "checksum": CHECKSUM_ALGORITHM,
            "byteorder": sys.byteorder,  # the payload is the tensor's native bytes
        },
        sort_keys=True,
        separators=(",", ":"),
    ).encode()
    body = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(header)) + header + payload
    return body + _digest(body)


def _parse_header(data: bytes) -> tuple[dict[str, Any], int]:
    """Checks framing and checksum; returns the header and where the payload starts."""
    n = len(data)
    min_len = _PREFIX.size + _DIGEST_SIZE
    if n < min_len:
        raise CorruptValue(f"truncated: {n} bytes, a value has at least {min_len}")
    magic, version, header_len = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise CorruptValue(f"bad magic {magic!r}, expected {MAGIC!r}")
    if header_len > _MAX_HEADER or _PREFIX.size + header_len + _DIGEST_SIZE > n:
        raise CorruptValue(f"truncated or bad header length: header_len={header_len}, value has {n} bytes")
    start = _PREFIX.size + header_len
    header: Any = None
    try:
        header = json.loads(data[_PREFIX.size : start])
    except (UnicodeDecodeError, ValueError, RecursionError):  # RecursionError: "[[[[..." nested too deep
        pass  # the checksum below names the damage
    payload_len = header.get("payload_bytes") if isinstance(header, dict) else None
    if _is_count(payload_len) and start + payload_len + _DIGEST_SIZE != n:
        raise CorruptValue(
            f"length mismatch: header says {start + payload_len + _DIGEST_SIZE} bytes, value has {n}"
            " (truncated or extended)"
        )
    body = memoryview(data)[:-_DIGEST_SIZE]
    if _digest(body) != data[-_DIGEST_SIZE:]:
        raise CorruptValue(f"{CHECKSUM_ALGORITHM} checksum mismatch over {len(body)} bytes")
    if version != FORMAT_VERSION:
        raise IncompatibleValue(f"format version {version} is not supported (this reader: {FORMAT_VERSION})")
    if not isinstance(header, dict) or not _is_count(payload_len):
        raise CorruptValue("header is not a JSON object with an integer payload_bytes")
    return header, start


def read_meta(data: bytes) -> KVBlockMeta:
    """The meta of a verified value, for inspection tools; raises KVFormatError like decode_block."""
    header, _ = _parse_header(data)
    return KVBlockMeta.from_json(header.get("meta"))


def decode_block(
    data: bytes, expected: KVBlockMeta, device: str | torch.device = "cpu", block: bytes = b""
) -> torch.Tensor:
    """The tensor in `data`, after checking framing, checksum, that its meta matches `expected` and that
    it was written for the block key `block`."""
    header, start = _parse_header(data)
    if header.get("block") != block.hex():
        raise IncompatibleValue(
            f"value is for block {str(header.get('block'))[:16]!r}..., not {block.hex()[:16]!r}..."
        )
    meta = KVBlockMeta.from_json(header.get("meta"))
    algorithm, compression = header.get("checksum"), header.get("compression")
    if algorithm != CHECKSUM_ALGORITHM:
        raise IncompatibleValue(f"checksum algorithm {algorithm!r}, this reader knows {CHECKSUM_ALGORITHM}")
    if compression not in _COMPRESSIONS:
        raise IncompatibleValue(f"compression {compression!r}, this reader knows {list(_COMPRESSIONS)}")
    if header.get("byteorder") != sys.byteorder:
        raise IncompatibleValue(f"byte order {header.get('byteorder')!r}, this machine is {sys.byteorder}")
    diffs = [
        f"{field} {getattr(meta, field)!r} != expected {getattr(expected, field)!r}"
        for field in ("model_fingerprint", "dtype", "shape", "token_count", "layout")
        if getattr(meta, field) != getattr(expected, field)
    ]
    if diffs:
        raise IncompatibleValue("value is for another block type: " + "; ".join(diffs))
    dtype = _DTYPES.get(meta.dtype)
    if dtype is None:
        raise IncompatibleValue(f"dtype {meta.dtype!r} is not supported; allowed: {sorted(_DTYPES)}")
    raw_len = math.prod(meta.shape) * dtype.itemsize
    if header.get("raw_bytes") != raw_len:
        raise CorruptValue(f"raw_bytes {header.get('raw_bytes')!r} != {raw_len} for shape {meta.shape}")
    payload = data[start:-_DIGEST_SIZE]
    if compression == "zlib":
        payload = _inflate(payload, raw_len)
    if len(payload) != raw_len:
        raise CorruptValue(f"payload has {len(payload)} bytes, shape {meta.shape} needs {raw_len}")
    if raw_len == 0:
        return torch.empty(meta.shape, dtype=dtype, device=device)
    flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype)
    return flat.reshape(meta.shape).to(device)


def _inflate(payload: bytes, raw_len: int) -> bytes:
    """Bounded decompression: a hostile value cannot make the reader allocate more than the shape needs."""
    inflater = zlib.decompressobj()
    try:
        out = inflater.decompress(payload, raw_len + 1)
    except zlib.error as exc:
        raise CorruptValue(f"zlib payload does not decompress: {exc}") from exc
    if len(out) > raw_len or not inflater.eof or inflater.unconsumed_tail or inflater.unused_data:
        raise CorruptValue(f"zlib payload does not inflate to exactly {raw_len} bytes")
    return out
