"""Triton adapter for scheduler.step: BYTES tensors in, token ids and engine parameters out."""

import json
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils
from tokenizers import Tokenizer

from adapters.scheduler_metrics import PrefixTokenizerMetrics
from cache.fingerprint import model_max_len, model_vocab_size, serving_fingerprint
from engine.config import parse_bool
from adapters.triton_common import (
    TritonWarmupSamples,
    error_response,
    log_event,
    model_parameters,
    request_parameters,
    warm_handler,
)
from scheduler.drain import DrainSwitch
from scheduler.step import SchedulerStep
from scheduler.tenant_auth import TenantAuth
from scheduler.tiers import TierTable
from scheduler.tokenize import PrefixTokenizer, max_prompt_chars, treat_special_tokens
from scheduler.validation import Limits


def _optional(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy().reshape(-1)[0]


def _input_or_parameter(request, extra, name):
    """An optional input that may also come as a request parameter of the same name; the tensor wins."""
    value = _optional(request, name)
    return value if value is not None else extra.get(name)


def _int_parameter(params, name, default, least):
    """An integer model-config parameter, refused naming it (as the engine's config does)."""
    raw = params.get(name, default)
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"parameter {name}={raw!r} is not an integer") from None
    if value < least:
        raise ValueError(f"parameter {name} must be >= {least}, got {value}")
    return value


class TritonPythonModel:
    def initialize(self, args):
        params = model_parameters(args)
        model_dir = Path(params["model_dir"])
        tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        treat_special_tokens(tokenizer, params.get("prompt_special_tokens", "text"))
        tiers = TierTable.load(params["tiers_file"]) if params.get("tiers_file") else TierTable.defaults()
        max_seq_len = _int_parameter(params, "max_seq_len", "2048", least=2)
        max_len = model_max_len(model_dir, max_seq_len)  # the engine's served limit (position embeddings)
        max_prompt = max_len - 1
        max_new_tokens = _int_parameter(params, "max_new_tokens", "512", least=1)
        exact_fingerprint = None
        if parse_bool("response_cache", params.get("response_cache", "true")):  # the engine's, same default
            exact_fingerprint = serving_fingerprint(model_dir, max_len, params.get("dtype", "float32"))
        self.encoder = PrefixTokenizer(tokenizer)
        self.encoder.warm()
        self._reported_off = False
        self.tokenizer_metrics = PrefixTokenizerMetrics(args["model_name"])
        self.drain = DrainSwitch(params["drain_file"]) if params.get("drain_file") else None
        self.triton_warmup = TritonWarmupSamples(json.loads(args["model_config"]))
        self.step = SchedulerStep(
            encode=self.encoder,
            limits=Limits(
                max_prompt_tokens=max_prompt,
                max_new_tokens=max_new_tokens,
                max_prompt_chars=max_prompt_chars(tokenizer, max_prompt),
            ),
            tiers=tiers.for_device(params.get("device", "cpu")),
            exact_fingerprint=exact_fingerprint,
            device=params.get("device", "cpu"),
            tenant_auth=TenantAuth.from_env(),
            vocab_size=model_vocab_size(model_dir),
        )
        warm_s = warm_handler(
            self._one,
            args["model_name"],
            {
                "text_input": np.array([b"Warm the tokenizer and validation paths"], dtype=np.object_),
                "sampling_parameters": np.array(
                    [b'{"max_tokens": 4, "temperature": 0.5, "seed": 1}'], dtype=np.object_
                ),
                "stream": np.array([True]),
            },
        )
        log_event(
            "scheduler_ready",
            tiers=list(self.step.tiers.names),
            max_prompt_tokens=max_prompt,
            hashes_exact_keys=exact_fingerprint is not None,
            self_warmup_ms=round(warm_s * 1000, 2),
        )

    def execute(self, requests):
        responses = [self._one(request, own=self.triton_warmup.next_is_own()) for request in requests]
        try:
            self.tokenizer_metrics.publish(self.encoder.stats)
        except Exception as exc:  # a metric message that failed must not fail the answered batch
            log_event("metrics_error", where="prefix_tokenizer", error=f"{type(exc).__name__}: {exc}")
        if not self.encoder.enabled and not self._reported_off:
            self._reported_off = True
            reason = "composed ids differed from a whole encode; prompts are encoded whole from now on"
            log_event("prefix_tokenizer_off", reason=reason, **asdict(self.encoder.stats))
        return responses

    def _one(self, request, local=False, own=False):
        try:
            if self.drain is not None and not local:
                self.drain.admit()
            extra = request_parameters(request)
            prepared = self.step.prepare(
                text=_optional(request, "text_input"),
                sampling_json=_optional(request, "sampling_parameters"),
                stream=_optional(request, "stream"),
                exclude_input_in_output=_optional(request, "exclude_input_in_output"),
                tier=_input_or_parameter(request, extra, "slo_tier"),
                tenant=_input_or_parameter(request, extra, "tenant"),
                now_ns=time.time_ns(),
                cache=_input_or_parameter(request, extra, "cache"),
                tenant_token=_input_or_parameter(request, extra, "tenant_token"),
                own=own or local,
            )
        except Exception as exc:  # every failure becomes this request's error, never the server's
            return error_response(exc)
        return pb_utils.InferenceResponse(
            output_tensors=[
                pb_utils.Tensor("input_ids", np.asarray(prepared.input_ids, dtype=np.int64)),
                pb_utils.Tensor("request_params", np.frombuffer(prepared.params.to_bytes(), dtype=np.uint8)),
                pb_utils.Tensor("priority", np.asarray([prepared.priority], dtype=np.int32)),
                pb_utils.Tensor("deadline_ns", np.asarray([prepared.deadline_ns], dtype=np.int64)),
            ]
        )
