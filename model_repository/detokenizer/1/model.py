"""Triton adapter for engine.detokenize: token windows in, UTF-8 text pieces out."""

from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from adapters.triton_common import (
    error_response,
    log_event,
    model_parameters,
    warm_handler,
)
from engine.cancel_mailbox import CancelMailbox
from engine.cancel_poll import PollSchedule
from engine.detokenize import TokenDecoder
from scheduler.errors import RequestError


def _text_response(piece: str):
    return pb_utils.InferenceResponse(
        output_tensors=[pb_utils.Tensor("text_output", np.array([piece], dtype=np.object_))]
    )


def _values(request, name):
    return pb_utils.get_input_tensor_by_name(request, name).as_numpy().reshape(-1)


def _request_key(request) -> tuple[int, int]:
    values = _values(request, "request_key")
    if len(values) != 2:
        raise ValueError(f"request_key must hold 2 values (namespace, key), got {len(values)}")
    return int(values[0]), int(values[1])


class TritonPythonModel:
    def initialize(self, args):
        params = model_parameters(args)
        self.decoder = TokenDecoder.from_model_dir(Path(params["model_dir"]))
        self.mailbox = CancelMailbox(params["cancel_dir"])
        self.polls = PollSchedule()  # is_cancelled is an IPC round trip: once per request per interval
        warm_s = warm_handler(
            self._one,
            args["model_name"],
            {
                "token_ids": np.arange(1, 9, dtype=np.int64),
                "read_offset": np.array([4], dtype=np.int32),
                "is_final": np.array([False]),
                "trim_bytes": np.array([0], dtype=np.int32),
                "request_key": np.array([0, 0], dtype=np.int64),
            },
        )
        log_event("detokenizer_ready", self_warmup_ms=round(warm_s * 1000, 2))

    def execute(self, requests):
        return [self._one(request) for request in requests]

    def _one(self, request, local=False):
        try:
            namespace, key = _request_key(request)
            final = bool(_values(request, "is_final")[0])
            if final:
                self.polls.forget((namespace, key))
            elif not local and self.polls.due((namespace, key)) and request.is_cancelled():
                self.mailbox.post(namespace, key)
                # Not an error response: in Triton 2.51 a step's error on a cancelled ensemble request
                # leaks that request (counted in flight forever; shutdown then waits its whole exit
                # timeout). The client is gone and reads nothing either way.
                return _text_response("")
            piece = self.decoder.delta(
                _values(request, "token_ids").tolist(),
                int(_values(request, "read_offset")[0]),
                final,
                int(_values(request, "trim_bytes")[0]),
            )
            return _text_response(piece)
        except ValueError as exc:  # a key, offset or trim that does not fit the window: the caller's
            return error_response(RequestError.invalid(str(exc)))
        except Exception as exc:
            return error_response(exc)
