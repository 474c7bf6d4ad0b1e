"""A token with no bytes (a special token: the loader's token_bytes is decoder.raw_bytes, b"" for
specials; EOS under ignore_eos) is released at once; when a stop string then completed, releasable()
counted it out again, so the final window started before tokens already sent and the detokenizer
refused it: the stream ended in INVALID_ARG (found in review, 2026-12-07)."""

from __future__ import annotations

from engine.detokenize import TokenDecoder
from engine.engine import Engine
from engine.model_runner import ModelRunner
from engine.stop_strings import StopMatcher
from tests.conftest import MODEL_DIR
from tests.test_engine_batching import (  # noqa: F401
    BUCKETS,
    EOS,
    RecordingSink,
    generate,
    make_engine,
    model,
    request,
    run_until_idle,
)


def test_a_released_empty_token_is_not_taken_back_when_a_stop_completes():
    matcher = StopMatcher(("bc",))
    assert not matcher.push(b"")  # e.g. a special token
    assert matcher.releasable(False) == (1, 0)  # sent to the client
    assert matcher.push(b"bc")
    count, trim = matcher.releasable(True)
    assert (count, trim) == (1, 0), f"releasable went from 1 to {count}: a token already sent retracted"


def test_final_stream_window_stays_valid_after_an_empty_token_then_a_stop(model):  # noqa: F811
    prompt = [1, 7, 9]
    free = generate(make_engine(model), prompt, max_tokens=4)
    first, second = free[0], free[1]
    assert first != second

    def token_bytes(t: int) -> bytes:
        return b"" if t == first else b"x" if t == second else b"y"

    runner = ModelRunner(model, slots=2, max_len=128, kv_buckets=BUCKETS)
    engine = Engine(runner, token_bytes, {EOS}, BUCKETS)
    sink = RecordingSink()
    engine.submit(request(prompt, sink, max_tokens=8, stop=("x",)))
    run_until_idle(engine)
    assert not sink.errors
    ids, offset, final = sink.windows[-1]
    assert final
    # what the detokenizer does with that final window
    decoder = TokenDecoder.from_model_dir(MODEL_DIR)
    assert decoder.delta(ids, offset, final=True, trim_bytes=sink.trim) == b""  # nothing after the stop
