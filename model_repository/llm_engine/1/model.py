"""Triton adapter for the engine: DLPack tensors in, streamed token windows out (numpy-free)."""

import json
import os
import threading
from dataclasses import asdict

import torch
import triton_python_backend_utils as pb_utils
from torch.utils.dlpack import from_dlpack, to_dlpack

from adapters.engine_metrics import TritonEngineObserver
from adapters.stub_messages import serialized, serialized_log
from adapters.triton_common import TritonWarmupSamples, log_event, model_parameters, triton_error
from engine.cancel_mailbox import CancelMailbox, request_keys
from engine.cancel_poll import ENGINE_CANCEL_POLL_S, PollSchedule, ThrottledCancelCheck
from engine.config import EngineConfig
from engine.loader import load_engine
from engine.requests import EngineRequest
from scheduler.errors import RequestError
from scheduler.messages import EngineRequestParams

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _tensor(name, values, dtype):
    return pb_utils.Tensor.from_dlpack(name, to_dlpack(torch.tensor(values, dtype=dtype)))


def _input(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return from_dlpack(tensor.to_dlpack()).reshape(-1)


class TritonSink:
    """Sends one request's windows through its decoupled response sender (from the engine thread)."""

    def __init__(self, request, key, messages):
        self.key = key
        self.request = request
        self.sender = request.get_response_sender()
        polls = PollSchedule(interval_s=ENGINE_CANCEL_POLL_S, limit=1)
        self.cancel_check = ThrottledCancelCheck(
            serialized(request.is_cancelled, messages), polls, tuple(key)
        )
        self.lock = threading.Lock()
        self.closed = False

    def send(self, token_ids, read_offset, final, trim_bytes):
        response = pb_utils.InferenceResponse(
            output_tensors=[
                _tensor("token_ids", token_ids, torch.int64),
                _tensor("read_offset", [read_offset], torch.int32),
                _tensor("is_final", [final], torch.bool),
                _tensor("trim_bytes", [trim_bytes], torch.int32),
                _tensor("request_key", self.key, torch.int64),
            ]
        )
        self._send(response, FINAL if final else 0)

    def fail(self, code, message):
        if code == "CANCELLED":  # the client is gone; an error here would leak the ensemble request
            self.send([], 0, True, 0)  # (see the detokenizer), so the request ends with an empty window
            return
        self._send(pb_utils.InferenceResponse(error=triton_error(code, message)), FINAL)

    def cancelled(self):
        # never ask after the final response: Triton has released the request by then, and an ask for
        # it crashed tritonserver (seen with a probe thread that outlived its requests)
        return not self.closed and self.cancel_check()

    def _send(self, response, flags):
        with self.lock:
            if self.closed:
                return
            self.sender.send(response, flags=flags)
            # closed once the final response went: a send that raised leaves the error for the final
            self.closed = bool(flags & FINAL)


class TritonPythonModel:
    def initialize(self, args):
        params = model_parameters(args)
        if params.get("prefill_templates") and not os.path.isabs(params["prefill_templates"]):
            params["prefill_templates"] = os.path.join(args["model_repository"], params["prefill_templates"])
        self.config = EngineConfig.from_parameters(params)
        self.messages = threading.Lock()  # this process's messages to the server: one at a time
        self.log_info = serialized(pb_utils.Logger.log_info, self.messages)  # for log_event's JSON lines
        observer = TritonEngineObserver(args["model_name"], self.messages)
        self.namespace = os.getpid()
        mailbox = CancelMailbox(self.config.cancel_dir)
        mailbox.open_inbox(self.namespace)
        self.keys = request_keys()
        self.triton_warmup = TritonWarmupSamples(json.loads(args["model_config"]))
        loaded = load_engine(
            self.config,
            observer,
            log=serialized_log(pb_utils.Logger.log_info, self.messages),
            cancelled_elsewhere=lambda: mailbox.collect(self.namespace),
            model_name=args["model_name"],
            model_version=str(args.get("model_version", "")),
        )
        self.engine = loaded.engine
        observer.record_warmup(loaded.report, loaded.kv_bytes, self.engine.runner.kv_bytes_per_token)
        log_event(
            "warmup_report",
            self.log_info,
            load_seconds=round(loaded.load_seconds, 3),
            report=asdict(loaded.report),
        )

    def execute(self, requests):
        for request in requests:
            key = next(self.keys)
            sink = TritonSink(request, [self.namespace, key], self.messages)
            own = self.triton_warmup.next_is_own()
            try:
                engine_request = EngineRequest(
                    request_id=str(key),
                    prompt_ids=_input(request, "input_ids").tolist(),
                    params=EngineRequestParams.from_bytes(bytes(_input(request, "request_params").tolist())),
                    priority=int(_input(request, "priority")[0]),
                    deadline_ns=int(_input(request, "deadline_ns")[0]),
                    sink=sink,
                )
            except RequestError as exc:
                sink.fail(exc.code, exc.message)
                continue
            except Exception as exc:  # malformed tensors fail this request only
                sink.fail("INVALID_ARG", f"bad engine input: {type(exc).__name__}: {exc}")
                continue
            try:
                self.engine.submit(engine_request, own=own)
            except RequestError as exc:
                sink.fail(exc.code, exc.message)
            except Exception as exc:  # the server's own failure, not the client's input: this request only
                sink.fail("INTERNAL", f"request failed to start: {type(exc).__name__}: {exc}")
        return None

    def finalize(self):
        self.engine.shutdown(self.config.drain_timeout_s)
        # no engine collects from it any more: notices posted there would pile up for the server's life
        CancelMailbox(self.config.cancel_dir).close_inbox(self.namespace)
        log_event("engine_stopped", self.log_info, stats=self.engine.stats.finished)
