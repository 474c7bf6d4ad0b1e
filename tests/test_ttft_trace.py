"""bench.ttft_trace reads Triton's trace files: the hops of an ensemble request's first token."""

import json

import pytest

from bench.ttft_trace import HOPS, hops_ms, load_traces


def _events(trace_id, model, parent, stamps):
    head = {"id": trace_id, "model_name": model, "model_version": 1}
    if parent is not None:
        head["parent_id"] = parent
    return [head] + [{"id": trace_id, "timestamps": [{"name": n, "ns": ns}]} for n, ns in stamps]


def test_hops_of_the_first_token_from_split_trace_files(tmp_path):
    ms = 1_000_000
    top = _events(1, "llm", None, [
        ("GRPC_WAITREAD_END", 0), ("GRPC_SEND_START", 9 * ms), ("GRPC_SEND_END", 10 * ms),
        ("GRPC_SEND_START", 20 * ms), ("GRPC_SEND_END", 21 * ms),
    ])  # fmt: skip
    sched = _events(
        2, "slo_scheduler", 1, [("REQUEST_START", ms), ("COMPUTE_START", 1 * ms), ("COMPUTE_END", 3 * ms)]
    )
    engine = _events(3, "llm_engine", 1, [("REQUEST_START", 3 * ms)])
    first = _events(
        4, "detokenizer", 1, [("REQUEST_START", 7 * ms), ("COMPUTE_START", 8 * ms), ("COMPUTE_END", 9 * ms)]
    )
    later = _events(
        5,
        "detokenizer",
        1,
        [("REQUEST_START", 15 * ms), ("COMPUTE_START", 16 * ms), ("COMPUTE_END", 19 * ms)],
    )
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(top + sched))
    (tmp_path / "trace.json.0").write_text(json.dumps(later + engine + first))
    (tmp_path / "trace.json.1").write_text('[{"id": 9, "timest')  # cut short by the shutdown: skipped
    traces = load_traces(path)
    assert traces[1].model == "llm" and traces[4].parent == 1
    children = [t for t in traces.values() if t.parent == 1]
    hops = dict(zip(HOPS, hops_ms(traces[1], children)))
    assert hops == pytest.approx({
        "to scheduler": 1, "scheduler compute": 2, "engine to first token": 4, "detok queue": 1,
        "detok compute": 1, "send": 1, "read to send end": 10,
    })  # fmt: skip
