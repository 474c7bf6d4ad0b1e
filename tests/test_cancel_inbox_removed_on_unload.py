"""An unloaded llm_engine left its cancel inbox (cancel_dir/<pid>) behind: the detokenizer, which Triton
serves to anyone and which outlives an engine reload, keeps posting notices into it (`post` only checks
that the folder exists), and no engine ever collects them again: files pile up for the server's life, and
one more folder per engine load.
(found in review, 2026-12-07)"""

from __future__ import annotations

import threading
import types

import pytest

from engine.cancel_mailbox import CancelMailbox
from tests import fake_triton_backend as ft


@pytest.fixture
def engine_model(monkeypatch):
    ft.install(monkeypatch)
    return ft.load_model("llm_engine")


def test_unloading_the_engine_closes_its_inbox(engine_model, tmp_path):
    class Engine:
        stats = types.SimpleNamespace(finished={})

        def shutdown(self, drain_timeout_s):
            pass

    m = engine_model.TritonPythonModel.__new__(engine_model.TritonPythonModel)
    m.engine, m.namespace = Engine(), 4321
    m.messages = threading.Lock()
    m.log_info = lambda message: None
    m.config = types.SimpleNamespace(drain_timeout_s=0.1, cancel_dir=str(tmp_path))
    mailbox = CancelMailbox(tmp_path)
    mailbox.open_inbox(m.namespace)
    assert mailbox.post(m.namespace, 1)  # a live engine's inbox takes notices
    m.finalize()
    for key in range(100):  # posts for the gone engine (a detokenizer request naming its namespace)
        assert not mailbox.post(m.namespace, key), "the unloaded engine's inbox still takes notices"
    assert not any(tmp_path.iterdir()), sorted(p.name for p in tmp_path.iterdir())
