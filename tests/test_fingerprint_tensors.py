"""The serving fingerprint changes when any one tensor of the checkpoint is retrained (review, 2026-12-07).

`checkpoint_digest` reads 64 evenly spaced 64 KiB windows of each weight file. In the tiny model 13 of its
40 tensors lie wholly between the windows, among them `self_attn.v_proj` of layers 0-2 and `q_proj`/`k_proj`
of layer 3, which compute the very KV that L3 stores: a checkpoint retrained there (a LoRA merge into those
projections, a norm-only fine-tune) keeps the old fingerprint, so every replica loads the old model's KV
blocks (and exact answers) from Redis as valid."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest

from cache import fingerprint
from tests.conftest import MODEL_DIR


def _tensors(path: Path) -> dict[str, tuple[int, int]]:
    with path.open("rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    base = 8 + n
    return {
        name: (base + v["data_offsets"][0], base + v["data_offsets"][1])
        for name, v in header.items()
        if name != "__metadata__"
    }


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    copy = tmp_path_factory.mktemp("ckpt") / "model"
    shutil.copytree(MODEL_DIR, copy)
    return copy


def test_retraining_any_single_tensor_changes_the_fingerprint(checkpoint):
    weights = checkpoint / "model.safetensors"
    original = weights.read_bytes()
    before = fingerprint.serving_fingerprint(checkpoint, 2048, "float32")
    unchanged = []
    try:
        for name, (start, end) in sorted(_tensors(weights).items()):
            data = bytearray(original)
            for i in range(start, end):  # every value of this tensor changes (a dense update)
                data[i] ^= 0x01
            weights.write_bytes(bytes(data))
            if fingerprint.serving_fingerprint(checkpoint, 2048, "float32") == before:
                unchanged.append(name)
    finally:
        weights.write_bytes(original)
    assert unchanged == [], f"retrained, same fingerprint: {unchanged}"
