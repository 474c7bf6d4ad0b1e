"""A sampling parameter nested just shallower than the JSON parser's limit parsed, and then the error
message's json.dumps of the value raised RecursionError: the scheduler step answered INTERNAL
("RecursionError: maximum recursion depth exceeded while encoding a JSON object") instead of INVALID_ARG."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from scheduler.errors import RequestError
from scheduler.validation import Limits, parse_sampling_parameters

# the window where json.loads succeeds but json.dumps does not is a couple of levels wide, just below the
# interpreter's recursion limit; where it lies depends on the caller's stack depth, so scan around it
DEPTHS = range(600, 1001)


@pytest.mark.parametrize("key", ["temperature", "max_tokens", "stop", "ignore_eos"])
def test_a_value_nested_near_the_parsers_limit_is_invalid_not_a_crash(key):
    limits = Limits(max_prompt_tokens=2047, max_new_tokens=512)
    for depth in DEPTHS:
        wrap = "[" * depth + "]" * depth
        value = f"[{wrap}]" if key == "stop" else wrap
        with pytest.raises(RequestError) as caught:
            parse_sampling_parameters(f'{{"{key}": {value}}}', limits)
        assert caught.value.code == "INVALID_ARG", depth


def _bytes(name: str, value: bytes) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, [1], "BYTES")
    tensor.set_data_from_numpy(np.array([value], dtype=np.object_))
    return tensor


def test_the_scheduler_step_answers_deep_nesting_with_invalid_arg(grpc_url):  # the shared server stack
    from client.generate import generate

    client = grpcclient.InferenceServerClient(grpc_url)
    wrong = []
    for depth in DEPTHS:
        raw = ('{"temperature": ' + "[" * depth + "]" * depth + "}").encode()
        try:
            client.infer("slo_scheduler", [_bytes("text_input", b"hi"), _bytes("sampling_parameters", raw)])
            wrong.append((depth, "accepted"))
        except InferenceServerException as exc:
            if "INVALID_ARG" not in str(exc.status()):
                wrong.append((depth, exc.status(), exc.message()[:80]))
    assert not wrong, wrong
    assert generate(grpc_url, "still serving", sampling={"max_tokens": 3}).text
