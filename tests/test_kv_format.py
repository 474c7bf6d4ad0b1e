"""The L3 KV block format: round trips, and every damaged or foreign value is refused."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
import zlib

import pytest
import torch

from cache.kv_format import (
    FORMAT_VERSION,
    CorruptValue,
    IncompatibleValue,
    KVBlockMeta,
    KVFormatError,
    decode_block,
    encode_block,
    read_meta,
)

SHAPE = (2, 2, 2, 16, 8)  # layers, k/v, kv_heads, block tokens, head_dim


def _meta(dtype: str = "bfloat16", shape: tuple[int, ...] = SHAPE, fingerprint: str = "fp-a") -> KVBlockMeta:
    return KVBlockMeta(
        model_fingerprint=fingerprint, dtype=dtype, shape=shape, token_count=16, layout="L2HBD-v1"
    )


def _block(dtype: torch.dtype, shape: tuple[int, ...] = SHAPE) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)


@pytest.mark.parametrize("compress", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip(dtype, compress):
    meta = _meta(str(dtype).removeprefix("torch."))
    block = _block(dtype)
    data = encode_block(block, meta, compress=compress)
    out = decode_block(data, meta)
    assert out.dtype == dtype and tuple(out.shape) == SHAPE
    assert torch.equal(out.reshape(-1).view(torch.uint8), block.reshape(-1).view(torch.uint8))  # bit exact
    assert read_meta(data) == meta


def test_round_trip_is_bit_exact_and_non_contiguous_input():
    meta = _meta("float32")
    base = _block(torch.float32, (SHAPE[0], SHAPE[1], SHAPE[2], SHAPE[4], SHAPE[3]))
    block = base.transpose(-1, -2)  # a non-contiguous view, as read out of a slot cache
    out = decode_block(encode_block(block, meta), meta)
    assert torch.equal(out, block) and out.is_contiguous()


def test_compression_shrinks_a_compressible_block():
    meta = _meta("bfloat16")
    block = torch.zeros(SHAPE, dtype=torch.bfloat16)
    assert len(encode_block(block, meta, compress=True)) < len(encode_block(block, meta)) // 4


def test_encode_rejects_meta_that_does_not_describe_the_tensor():
    with pytest.raises(ValueError, match="dtype"):
        encode_block(_block(torch.float16), _meta("bfloat16"))
    with pytest.raises(ValueError, match="shape"):
        encode_block(_block(torch.bfloat16, (1, 2, 2, 16, 8)), _meta("bfloat16"))


@pytest.mark.parametrize("compress", [False, True])
def test_every_single_byte_flip_is_detected(compress):
    meta = _meta("bfloat16", shape=(1, 2, 1, 4, 4))
    data = encode_block(_block(torch.bfloat16, meta.shape), meta, compress=compress)
    for pos in range(len(data)):
        damaged = bytearray(data)
        damaged[pos] ^= 0xFF
        with pytest.raises(CorruptValue):
            decode_block(bytes(damaged), meta)
        damaged[pos] = data[pos] ^ 0x01  # a single-bit flip too
        with pytest.raises(CorruptValue):
            decode_block(bytes(damaged), meta)


@pytest.mark.parametrize("compress", [False, True])
def test_truncation_at_every_length_is_detected(compress):
    meta = _meta("float16", shape=(1, 2, 1, 4, 4))
    data = encode_block(_block(torch.float16, meta.shape), meta, compress=compress)
    for n in range(len(data)):
        with pytest.raises(CorruptValue):
            decode_block(data[:n], meta)
    with pytest.raises(CorruptValue, match="length mismatch"):
        decode_block(data + b"\0", meta)


def test_truncation_message_names_it():
    meta = _meta("float32")
    data = encode_block(_block(torch.float32), meta)
    with pytest.raises(CorruptValue, match="truncated"):
        decode_block(data[: len(data) // 2], meta)
    with pytest.raises(CorruptValue, match="truncated"):
        decode_block(data[:5], meta)


@pytest.mark.parametrize(
    "field,value",
    [
        ("model_fingerprint", "fp-b"),
        ("dtype", "float16"),
        ("shape", (2, 2, 2, 8, 8)),
        ("token_count", 8),  # a block written as partly filled is no full block of the same shape
        ("layout", "LBHD-v2"),
    ],
)
def test_value_for_another_block_type_is_incompatible(field, value):
    meta = _meta("bfloat16")
    data = encode_block(_block(torch.bfloat16), meta)
    expected = dataclasses.replace(meta, **{field: value})
    with pytest.raises(IncompatibleValue, match=field):
        decode_block(data, expected)


def test_errors_share_a_base_class():
    assert issubclass(CorruptValue, KVFormatError) and issubclass(IncompatibleValue, KVFormatError)
    assert not issubclass(CorruptValue, IncompatibleValue)


def _reframe(data: bytes, header_edit=None, version: int | None = None) -> bytes:
    """Re-sign a value after editing it, as a writer of another version or a hostile writer could."""
    magic, ver, hlen = struct.unpack_from("<4sHI", data)
    header = json.loads(data[10 : 10 + hlen])
    payload = data[10 + hlen : -16]
    if header_edit:
        header_edit(header)
    hb = json.dumps(header).encode()
    body = struct.pack("<4sHI", magic, ver if version is None else version, len(hb)) + hb + payload
    return body + hashlib.blake2b(body, digest_size=16).digest()


def test_intact_value_of_an_unknown_version_is_incompatible():
    meta = _meta("float32")
    data = _reframe(encode_block(_block(torch.float32), meta), version=3)
    with pytest.raises(IncompatibleValue, match="version 3"):
        decode_block(data, meta)


def test_signed_but_malformed_headers_are_refused():
    meta = _meta("float32")
    data = encode_block(_block(torch.float32), meta, compress=True)

    def bad_shape(h):
        h["meta"]["shape"] = "x"

    def bad_raw(h):
        h["raw_bytes"] = 10**12

    with pytest.raises(CorruptValue, match="shape"):
        decode_block(_reframe(data, bad_shape), meta)
    with pytest.raises(CorruptValue, match="raw_bytes"):
        decode_block(_reframe(data, bad_raw), meta)


def test_zip_bomb_is_bounded():
    """A validly signed value whose payload inflates past the shape's size is refused."""
    meta = _meta("float32", shape=(1, 1, 1, 1, 4))
    raw_len = 16
    payload = zlib.compress(b"\0" * (1 << 20), 1)
    header = json.dumps(
        {
            "meta": meta.to_json(),
            "block": "",
            "payload_bytes": len(payload),
            "raw_bytes": raw_len,
            "compression": "zlib",
            "checksum": "blake2b-128",
            "byteorder": "little",
        }
    ).encode()
    body = struct.pack("<4sHI", b"TWKV", FORMAT_VERSION, len(header)) + header + payload
    data = body + hashlib.blake2b(body, digest_size=16).digest()
    with pytest.raises(CorruptValue, match="inflate"):
        decode_block(data, meta)


def test_a_value_is_bound_to_its_block_key():
    """A value copied under another block's name is intact but not that block's KV (another tenant's, at
    worst): refused as incompatible, and so deleted by the store."""
    meta, block = _meta(), _block(torch.bfloat16)
    data = encode_block(block, meta, block=b"\x01" * 32)
    assert torch.equal(decode_block(data, meta, block=b"\x01" * 32), block)
    with pytest.raises(IncompatibleValue, match="value is for block"):
        decode_block(data, meta, block=b"\x02" * 32)
    with pytest.raises(IncompatibleValue, match="value is for block"):
        decode_block(data, meta)  # a reader that names no block takes only unbound values
