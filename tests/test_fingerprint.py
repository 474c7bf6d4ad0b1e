"""The serving fingerprint names every cache entry of one model configuration (KV blocks, answers): it is
the same in every process for the same checkpoint and changes with anything that changes the answers,
weights and tokenizer included, so an updated model never serves the old one's cached KV or answers."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cache.fingerprint import WEIGHT_SAMPLE_BYTES, serving_fingerprint
from tests.conftest import MODEL_DIR


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    copy = tmp_path / "model"
    shutil.copytree(MODEL_DIR, copy)
    return copy


def fingerprint(model_dir: Path) -> str:
    return serving_fingerprint(model_dir, 2048, "float32")


def test_the_fingerprint_is_the_same_in_another_process(checkpoint):
    code = (
        "from pathlib import Path; from cache.fingerprint import serving_fingerprint;"
        f"print(serving_fingerprint(Path({str(checkpoint)!r}), 2048, 'float32'))"
    )
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert other.strip() == fingerprint(checkpoint) == fingerprint(MODEL_DIR)


def flip_a_weight_byte(model_dir: Path) -> None:
    """A retrained checkpoint: same config.json, same file size, other values (here one byte, at a sample)."""
    path = model_dir / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[len(data) - WEIGHT_SAMPLE_BYTES] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "change",
    [
        flip_a_weight_byte,
        lambda d: (d / "tokenizer.json").write_text(
            (d / "tokenizer.json").read_text().replace('"<s>"', '"<S>"')
        ),
        lambda d: (d / "generation_config.json").write_text('{"eos_token_id": 7}'),
    ],
    ids=["weights", "tokenizer", "generation_config"],
)
def test_the_fingerprint_changes_with_the_weights_and_the_tokenizer(checkpoint, change):
    before = fingerprint(checkpoint)
    change(checkpoint)
    assert fingerprint(checkpoint) != before
    assert fingerprint(checkpoint).endswith("|float32|slot-kv-v1")
