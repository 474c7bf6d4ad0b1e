"""Found in review (2026-12-07): slo_scheduler's model-config parameters. The engine names a bad parameter
(engine/config.py); the scheduler step, which reads the same LLM_MAX_SEQ_LEN / LLM_MAX_NEW_TOKENS, failed
its load with a bare int() error, and held prompts to max_seq_len - 1 even where the checkpoint's
position embeddings cap the engine lower (model_max_len), so it tokenized and passed on prompts the
engine can never take."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests import fake_triton_backend as ft
from tests.conftest import MODEL_DIR as TINY_DIR
from tests.conftest import REPO_ROOT

MODEL_DIR = str(TINY_DIR)  # max_position_embeddings 2048


def _module(monkeypatch):
    ft.install(monkeypatch)
    path = REPO_ROOT / "model_repository" / "slo_scheduler" / "1" / "model.py"
    spec = importlib.util.spec_from_file_location("_review_slo_scheduler_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _init(monkeypatch, **params):
    module = _module(monkeypatch)
    config = {"parameters": {k: {"string_value": v} for k, v in {"model_dir": MODEL_DIR, **params}.items()}}
    model = module.TritonPythonModel()
    model.initialize({"model_config": json.dumps(config), "model_name": "slo_scheduler"})
    return model


@pytest.mark.parametrize(
    ("name", "value"),
    [("max_seq_len", "abc"), ("max_seq_len", ""), ("max_new_tokens", "1e3"), ("max_new_tokens", "0")],
)
def test_a_bad_parameter_fails_the_load_naming_it(monkeypatch, name, value):
    with pytest.raises(ValueError, match=name):
        _init(monkeypatch, **{name: value})


def test_prompt_limit_is_the_engines_served_limit(monkeypatch):
    """max_seq_len 4096 over a 2048-position checkpoint: the engine serves 2048 (prompts of at most 2047
    tokens); the step let a 3000-token prompt through."""
    model = _init(monkeypatch, max_seq_len="4096")
    assert model.step.limits.max_prompt_tokens == 2047
