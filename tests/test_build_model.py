"""engine.build_model: tokenizer + seeded random Llama written with save_pretrained, reloaded with Auto*."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.build_model import STAMP_NAME, build, main

VOCAB = 2048  # smaller than the default 8192: faster, same code path

TEXTS = [
    "Once upon a time, the server was cold.",
    "  leading spaces,\ttabs and\nnewlines  ",
    "Größe, naïve café, Ελληνικά, 日本語のテキスト, emoji 🙂🚀, combining é",
]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("models") / "tiny"
    build("tiny", out, seed=7, vocab_size=VOCAB)
    return out


def test_files_written(built: Path) -> None:
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", STAMP_NAME):
        assert (built / name).is_file(), name
    cfg = json.loads((built / "config.json").read_text())
    assert cfg["model_type"] == "llama"
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]) == (256, 4, 4)
    assert (cfg["num_key_value_heads"], cfg["intermediate_size"], cfg["max_position_embeddings"]) == (
        2,
        688,
        2048,
    )
    assert cfg["vocab_size"] <= VOCAB


def test_reload_with_auto_classes(built: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(built)
    model = AutoModelForCausalLM.from_pretrained(built)
    assert model.dtype == torch.float32
    assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token) == ("<s>", "</s>", "<pad>", "<unk>")
    assert model.config.bos_token_id == tok.bos_token_id
    assert model.config.eos_token_id == tok.eos_token_id
    gen = GenerationConfig.from_pretrained(built)
    assert (gen.bos_token_id, gen.eos_token_id) == (tok.bos_token_id, tok.eos_token_id)
    assert len(tok) == model.config.vocab_size

    ids = tok("Once upon a time", return_tensors="pt")["input_ids"]
    assert ids[0, 0].item() == tok.bos_token_id
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_and_bos(built: Path, text: str) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built)
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert tok.unk_token_id not in ids  # byte-level: every byte has a token
    assert tok.decode(ids, skip_special_tokens=True) == text
    # the raw tokenizers file (what slo_scheduler loads) agrees
    raw = Tokenizer.from_file(str(built / "tokenizer.json"))
    assert raw.encode(text).ids == ids
    assert raw.decode(ids) == text


def test_deterministic_weights_for_a_seed(built: Path, tmp_path: Path) -> None:
    again = build("tiny", tmp_path / "again", seed=7, vocab_size=VOCAB)
    other = build("tiny", tmp_path / "other", seed=8, vocab_size=VOCAB)
    a = load_file(built / "model.safetensors")
    b = load_file(again / "model.safetensors")
    c = load_file(other / "model.safetensors")
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)
    assert (built / "tokenizer.json").read_text() == (again / "tokenizer.json").read_text()


def test_idempotent_skip_and_rebuild_on_change(built: Path, capsys) -> None:
    weights = built / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    build("tiny", built, seed=7, vocab_size=VOCAB)
    assert "up to date" in capsys.readouterr().out
    assert weights.stat().st_mtime_ns == mtime


def test_dtype_option(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    out = tmp_path / "bf16"
    assert main(["--preset", "tiny", "--out", str(out), "--dtype", "bfloat16", "--vocab-size", "1024"]) == 0
    assert all(t.dtype == torch.bfloat16 for t in load_file(out / "model.safetensors").values())
    assert AutoModelForCausalLM.from_pretrained(out).dtype == torch.bfloat16


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="preset"):
        build("huge", tmp_path / "x")
    assert main(["--out", str(tmp_path / "y"), "--dtype", "float7"]) == 2
