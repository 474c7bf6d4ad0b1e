"""Found in review: a direct request's token id that no tokenizer can hold (negative, or past
32 bits) is bad input: with a sentencepiece tokenizer (text-diff decoding) `Tokenizer.decode` raised
OverflowError, answered INTERNAL ("OverflowError: number too small ..."), where every other bad window
(offset, trim, key) is INVALID_ARG. The byte-level path ignores such ids, as unknown ones."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests import fake_triton_backend as ft
from tests.test_detokenize import train_byte_fallback


@pytest.fixture
def detokenizer(monkeypatch, tmp_path):
    ft.install(monkeypatch)
    module = ft.load_model("detokenizer")
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    train_byte_fallback().save(str(model_dir / "tokenizer.json"))
    parameters = {"model_dir": str(model_dir), "cancel_dir": str(tmp_path / "cancel")}
    config = {"parameters": {k: {"string_value": v} for k, v in parameters.items()}}
    model = module.TritonPythonModel()
    model.initialize({"model_config": json.dumps(config), "model_name": "detokenizer"})
    return model


def request(ids, read_offset=0, final=True, trim=0):
    inputs = {
        "token_ids": np.array(ids, dtype=np.int64),
        "read_offset": np.array([read_offset], dtype=np.int32),
        "is_final": np.array([final]),
        "trim_bytes": np.array([trim], dtype=np.int32),
        "request_key": np.array([0, 1], dtype=np.int64),
    }
    return ft.InferenceRequest("detokenizer", [ft.Tensor(k, v) for k, v in inputs.items()])


@pytest.mark.parametrize("bad", [-1, 2**40])
def test_out_of_range_token_id_is_invalid_arg(detokenizer, bad) -> None:
    (response,) = detokenizer.execute([request([5, bad, 6])])
    assert response.has_error()
    assert response.error().code() == ft.TritonError.INVALID_ARG, response.error().message()
    assert str(bad) in response.error().message()


def test_in_range_ids_still_decode(detokenizer) -> None:
    (response,) = detokenizer.execute([request([5, 10**6, 6])])  # an unknown id decodes to nothing
    assert not response.has_error()
    assert isinstance(response.tensor("text_output")[0], bytes)
