"""client.workload.read_perf_analyzer_profile: TTFT as client.load defines it (send -> first non-empty
piece). Found in review: it read the first response of any kind, so a first token that ends inside a
UTF-8 character (the detokenizer answers it with an empty piece) gave perf_analyzer's table the time to
the first token while client.load's table, which it is set beside, shows the time to the first text."""

from __future__ import annotations

import json

import pytest

from client.load import records_from_profile, summarize
from client.workload import read_perf_analyzer_profile

MS = 1_000_000  # ns


def profile(tmp_path, outputs, stamps_ms):
    data = {"experiments": [{"experiment": {"mode": "concurrency", "value": 1}, "requests": [{
        "timestamp": 1_000 * MS,
        "request_inputs": {"slo_tier": "standard", "tenant": "t"},
        "response_timestamps": [1_000 * MS + s * MS for s in stamps_ms],
        "response_outputs": outputs,
    }]}]}  # fmt: skip
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(data))
    return read_perf_analyzer_profile(path)


def test_a_held_back_first_token_does_not_count_as_the_first_text(tmp_path):
    # first token held back (empty piece at 10 ms), text at 30 ms and 40 ms, the empty final response at 45 ms
    (p,) = profile(tmp_path, [{"text_output": ""}, {"text_output": "\u00e9"}, {"text_output": "a"}, {}],
                   [10, 30, 40, 45])  # fmt: skip
    assert p.output_pieces == 2
    assert p.ttft_s == pytest.approx(0.030)  # as client.load: the first non-empty piece
    assert p.total_s == pytest.approx(0.045)
    (record,) = records_from_profile([p])["concurrency=1"]
    assert record.tpot_s == pytest.approx((0.045 - 0.030) / 1)
    assert summarize([record], {"standard": 20.0})[0].attainment == 0.0  # 30 ms misses a 20 ms target


def test_the_ordinary_case_is_unchanged(tmp_path):
    (p,) = profile(tmp_path, [{"text_output": "a"}, {"text_output": "b"}, {}], [12, 20, 25])
    assert p.ttft_s == pytest.approx(0.012) and p.total_s == pytest.approx(0.025) and p.output_pieces == 2
