"""The header's byte order must be the writer's: the payload is the tensor's native bytes. Written as
"little" whatever the host, a big-endian replica refuses (and deletes) every value it wrote itself, and a
little-endian one would accept a big-endian replica's bytes as its own."""

from __future__ import annotations

import types

import torch

import cache.kv_format as kv_format
from cache.kv_format import KVBlockMeta, decode_block, encode_block, read_meta

META = KVBlockMeta("fp", "bfloat16", (2, 2, 2, 4, 8), 4, "L2HBD-v1")
KEY = b"k" * 32


def test_a_value_names_the_byte_order_of_the_host_that_wrote_it(monkeypatch):
    block = torch.randn(META.shape).to(torch.bfloat16)
    monkeypatch.setattr(kv_format, "sys", types.SimpleNamespace(byteorder="big"))  # a big-endian host
    value = encode_block(block, META, block=KEY)
    assert torch.equal(decode_block(value, META, block=KEY), block)  # it reads back what it wrote
    monkeypatch.undo()  # a little-endian reader must not take a big-endian writer's bytes
    assert read_meta(value) == META
    try:
        decode_block(value, META, block=KEY)
    except kv_format.IncompatibleValue:
        pass
    else:
        raise AssertionError("a value written on a big-endian host was decoded on a little-endian one")
