"""A running non-streaming request sends empty non-final windows (engine/engine.py, NON_STREAM_KEEPALIVE_S),
so a cancel that only the detokenizer sees (it sees only requests that send something) ends it early; the
final answer is unchanged (found in review, 2026-12-07)."""

from __future__ import annotations

import engine.engine as engine_module
from tests.test_engine_batching import RecordingSink, make_engine, model, request  # noqa: F401


class DetokenizerSink(RecordingSink):
    """Stands for the detokenizer behind the engine: the client is gone, so the first window that reaches
    it after its first poll interval (Triton's is_cancelled) posts the request's key to the mailbox."""

    def __init__(self, mailbox: set):
        super().__init__()
        self.mailbox = mailbox

    def send(self, token_ids, read_offset, final, trim_bytes=0):
        super().send(token_ids, read_offset, final, trim_bytes)
        if not final and len(self.windows) >= 2:
            self.mailbox.add("r")


def test_a_cancelled_non_streaming_request_ends_before_max_tokens(model, monkeypatch):  # noqa: F811
    monkeypatch.setattr(engine_module, "NON_STREAM_KEEPALIVE_S", 0.0)
    mailbox: set = set()
    engine = make_engine(model)
    engine.cancelled_elsewhere = lambda: set(mailbox)
    sink = DetokenizerSink(mailbox)
    engine.submit(request([1, 5, 6, 7], sink, rid="r", max_tokens=60, stream=False))
    for _ in range(200):
        if sink.finished or not engine.step():
            break
    assert sink.finished
    assert engine.stats.finished.get("cancelled") == 1, engine.stats.finished
    assert engine.stats.finished.get("length") is None
    assert not engine._active and len(engine._free) == engine.runner.slots


def test_keepalives_leave_a_non_streaming_answer_unchanged(model, monkeypatch):  # noqa: F811
    def answer(keepalive_s: float) -> tuple[list, list]:
        monkeypatch.setattr(engine_module, "NON_STREAM_KEEPALIVE_S", keepalive_s)
        engine = make_engine(model)
        sink = RecordingSink()
        engine.submit(request([1, 5, 6, 7], sink, max_tokens=20, stream=False, exclude_input_in_output=True))
        while engine.step():
            pass
        finals = [w for w in sink.windows if w[2]]
        return finals, [w for w in sink.windows if not w[2]]

    finals_quiet, extra_quiet = answer(3600.0)
    finals, extra = answer(0.0)
    assert finals == finals_quiet and len(finals[0][0]) == 20
    assert extra_quiet == [] and extra and all(w == ([], 0, False) for w in extra)
