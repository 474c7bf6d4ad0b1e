"""DevicePrewarm "stops between items as soon as the load is done (`finish`), so it never delays READY by
more than one item". A `finish()` that arrives while the first item (the sampling path) runs must stop it
there; the prewarm went on to build its one-layer model and KV pools (a config read, a model constructed,
device memory for the embedding, lm_head and every slot) before it looked at the stop."""

from __future__ import annotations

import threading

import torch

import engine.device_prewarm as device_prewarm
from engine.device_prewarm import DevicePrewarm, PrewarmShape
from tests.conftest import MODEL_DIR


def test_a_finish_during_the_sampling_item_stops_before_the_model_copy_is_built(monkeypatch):
    shape = PrewarmShape(slots=2, max_len=64, buckets=(16, 64), pools=[(64, 2)], order=(16, 64))
    prewarm = DevicePrewarm(str(MODEL_DIR), torch.float32, "cpu", shape, origin_ns=0)
    built: list[bool] = []
    real_sampling, real_runner = device_prewarm.warm_sampling, DevicePrewarm._one_layer_runner
    finishing = threading.Event()

    def sampling_while_the_load_ends(*args):
        result = real_sampling(*args)
        threading.Thread(target=lambda: finishing.set() or prewarm.finish()).start()
        prewarm._stop.wait(10)  # finish() has asked to stop while this item ran
        return result

    def runner(self, config):
        built.append(True)
        return real_runner(self, config)

    monkeypatch.setattr(device_prewarm, "warm_sampling", sampling_while_the_load_ends)
    monkeypatch.setattr(DevicePrewarm, "_one_layer_runner", runner)
    prewarm.start()
    assert finishing.wait(30)
    prewarm._thread.join(30)
    assert prewarm.summary.error is None
    assert prewarm.summary.done == ["sampling"]
    assert built == [], "the model copy was built after the stop"
