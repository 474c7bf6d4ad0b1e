"""A stand-in for triton_python_backend_utils, close to the real stub's behaviour, for tests that load a
model.py without a server (written in review, 2026-12-07)."""

from __future__ import annotations

import importlib.util
import json
import sys
import types

import numpy as np


class TritonError:
    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS, CANCELLED = range(8)

    def __init__(self, message, code=0):
        message.encode("utf-8")  # pybind11 converts str to std::string as UTF-8
        self._message, self._code = message, code

    def message(self):
        return self._message

    def code(self):
        return self._code


class Tensor:
    def __init__(self, name, value):
        self._name, self._value = name, np.asarray(value)

    def name(self):
        return self._name

    def as_numpy(self):
        return self._value

    def to_dlpack(self):
        import torch

        return torch.from_numpy(np.ascontiguousarray(self._value)).__dlpack__()

    @classmethod
    def from_dlpack(cls, name, capsule):
        import torch

        return cls(name, torch.from_dlpack(capsule).numpy())


class InferenceResponse:
    def __init__(self, output_tensors=None, error=None):
        self._tensors, self._error = output_tensors or [], error

    def has_error(self):
        return self._error is not None

    def error(self):
        return self._error

    def output_tensors(self):
        return self._tensors

    def tensor(self, name):
        return next(t for t in self._tensors if t.name() == name).as_numpy()


class Sender:
    def __init__(self):
        self.sent = []  # (response, flags)
        self.fail_next = 0

    def send(self, response=None, flags=0):
        if self.fail_next:
            self.fail_next -= 1
            raise RuntimeError("Failed to increase the shared memory pool size")
        self.sent.append((response, flags))


class InferenceRequest:
    def __init__(self, model_name="", inputs=(), requested_output_names=(), parameters=None, cancelled=False):
        self.inputs = {t.name(): t for t in inputs}
        self._parameters = json.dumps(parameters or {})
        self.cancelled = cancelled
        self.cancel_asks = 0
        self.sender = Sender()

    def parameters(self):
        return self._parameters

    def is_cancelled(self):
        self.cancel_asks += 1
        return self.cancelled

    def get_response_sender(self):
        return self.sender


def get_input_tensor_by_name(request, name):
    return request.inputs.get(name)


class Logger:
    lines: list[str] = []

    @classmethod
    def log_info(cls, message):
        message.encode("utf-8")
        cls.lines.append(message)

    log_warn = log_error = log_verbose = log_info


class _Metric:
    def __init__(self, **create):
        self.total = 0.0

    def increment(self, v):
        self.total += v

    def set(self, v):
        self.total = v

    def observe(self, v):
        pass


class MetricFamily:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

    def __init__(self, name, description, kind):
        self.name = name

    def Metric(self, **create):  # noqa: N802
        return _Metric(**create)


def install(monkeypatch):
    mod = types.ModuleType("triton_python_backend_utils")
    for name in (
        "TritonError",
        "Tensor",
        "InferenceResponse",
        "InferenceRequest",
        "get_input_tensor_by_name",
        "Logger",
        "MetricFamily",
    ):
        setattr(mod, name, globals()[name])
    mod.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
    Logger.lines = []
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", mod)
    for name in ("adapters.triton_common", "adapters.engine_metrics", "adapters.scheduler_metrics"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return mod


def load_model(name):
    path = f"/work/main/model_repository/{name}/1/model.py"
    spec = importlib.util.spec_from_file_location(f"_review_{name}_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class RecordedSeries:
    """One metric series: counters add, gauges set; `fail_next` messages raise, as a failed IPC does."""

    def __init__(self, counter: bool):
        self.counter, self.total, self.fail_next = counter, 0.0, 0

    @property
    def value(self) -> float:
        return self.total

    def _message(self) -> None:
        if self.fail_next:
            self.fail_next -= 1
            raise RuntimeError("metric message failed")

    def increment(self, v):
        self._message()
        if self.counter and not v >= 0:  # Triton refuses negatives; NaN poisons a prometheus counter
            raise ValueError(f"counter increment {v}")
        self.total += v

    def set(self, v):
        self._message()
        self.total = v

    def observe(self, v):
        self._message()
        self.total += v


def install_metrics(monkeypatch) -> dict:
    """A `triton_python_backend_utils` of MetricFamily only; returns {(name, sorted labels): series}. The
    metric adapters are imported afresh against it."""
    series: dict = {}

    class Family:
        COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

        def __init__(self, name, description, kind):
            self.name, self.kind = name, kind

        def Metric(self, labels, **_):  # noqa: N802
            key = (self.name, tuple(sorted(labels.items())))
            return series.setdefault(key, RecordedSeries(self.kind == "counter"))

    monkeypatch.setitem(
        sys.modules, "triton_python_backend_utils", types.SimpleNamespace(MetricFamily=Family)
    )
    for name in ("adapters.engine_metrics", "adapters.scheduler_metrics"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return series
