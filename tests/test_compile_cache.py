"""torch.compile of the decode step during warmup, with its cache kept between restarts.

Starts the engine in-process (engine.loader, no Triton) on the tiny model with one KV bucket, so a
cold compile is one inductor compile (~15-20 s on a 2-core CPU, most of it the C++ compiler) and
the rest are cache hits. A "restart" in one process is `torch.compiler.reset()` (drops Dynamo's
in-memory code) followed by a new engine on the same cache directory: what comes back must come
from the on-disk cache, which the report records (FX-graph/AOTAutograd cache hits and misses).
The tests share the module's engines and run in file order.
"""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import pytest
import torch

from engine.compile_cache import compile_cache_for
from engine.config import EngineConfig
from engine.loader import load_engine
from engine.requests import EngineRequest
from scheduler.messages import EngineRequestParams

REPO_ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO_ROOT / "models" / "tiny-llama"
PROMPT = [0, 17, 250, 33, 901, 12, 77, 5]


def _config(cache_dir: Path, compile_on: bool = True) -> EngineConfig:
    # max_seq_len 32 with one prompt bucket of 32: a single KV bucket, hence a single compile
    return EngineConfig(
        model_dir=str(MODEL_DIR),
        max_seq_len=32,
        prompt_buckets=(32,),
        max_batch_size=2,
        prefix_cache_blocks=0,
        prefill_templates="",
        compile=compile_on,
        compile_cache_dir=str(cache_dir),
    )


class _Sink:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.errors: list[tuple[str, str]] = []
        self.done = threading.Event()

    def send(self, token_ids, read_offset, final, trim_bytes=0):
        self.tokens.extend(token_ids[read_offset:])
        if final:
            self.done.set()

    def fail(self, code, message):
        self.errors.append((code, message))
        self.done.set()

    def cancelled(self):
        return False


def _greedy(loaded, max_tokens: int = 16) -> list[int]:
    sink = _Sink()
    params = EngineRequestParams(max_tokens=max_tokens, ignore_eos=True, exclude_input_in_output=True)
    loaded.engine.submit(EngineRequest(f"greedy-{time.monotonic_ns()}", PROMPT, params, 2, 0, sink))
    assert sink.done.wait(60), "request did not finish"
    assert not sink.errors
    return sink.tokens


def _start(config: EngineConfig):
    return load_engine(config, log=lambda message: None, model_name="llm_engine", model_version="1")


@pytest.fixture(scope="module")
def starts(tmp_path_factory):
    if not (MODEL_DIR / "config.json").exists():
        from engine.build_model import build

        build("tiny", MODEL_DIR)
    cache_dir = tmp_path_factory.mktemp("compile-cache")
    torch.compiler.reset()
    loaded = []
    try:
        for _ in range(2):
            torch.compiler.reset()  # this start must find the code on disk, not in this process
            loaded.append(_start(_config(cache_dir)))
        yield cache_dir, loaded
    finally:
        for item in loaded:
            item.engine.shutdown(1.0)


def test_compiled_decode_gives_the_eager_greedy_tokens(starts, tmp_path):
    _, (first, second) = starts
    eager = _start(_config(tmp_path, compile_on=False))
    try:
        assert eager.report.compile == {} and not eager.engine.runner.compiled_buckets
        assert first.engine.runner.compiled_buckets == {32} == second.engine.runner.compiled_buckets
        expected = _greedy(eager)
        assert len(expected) == 16
        assert _greedy(second) == expected
        # served by the compiled code: no step of the compiled bucket fell back to eager
        assert second.engine.runner.compile_fallbacks == 0
        assert _greedy(first) == expected
    finally:
        eager.engine.shutdown(1.0)


def test_second_start_loads_the_compiled_code_from_the_cache(starts):
    cache_dir, (first, second) = starts
    for loaded in (first, second):
        names = [stage.name for stage in loaded.report.stages]
        assert names[:3] == ["plan", "compile", "prefill_buckets"]
        assert not loaded.report.failures
    cold, warm = first.report.compile, second.report.compile
    assert cold["cache_dir"] == warm["cache_dir"] and Path(cold["cache_dir"]).parent == cache_dir
    assert cold["outcome"] == "miss" and cold["cache"]["fxgraph_miss"] >= 1
    assert cold["artifacts_saved_bytes"] > 0 and (Path(cold["cache_dir"]) / "artifacts.bin").exists()
    assert warm["outcome"] == "hit", warm
    assert warm["cache"]["fxgraph_hit"] >= 1 and warm["cache"]["fxgraph_miss"] == 0
    assert warm["compiled_buckets"] == [32] and warm["eager_buckets"] == []
    assert cold["fallback_steps"] == 0 == warm["fallback_steps"]


def test_artifacts_file_alone_restores_the_cache(starts):
    """A fresh volume that kept only artifacts.bin (e.g. shipped in an image): hot-loaded, then hits."""
    cache_dir, (first, _) = starts
    keyed = Path(first.report.compile["cache_dir"])
    shutil.rmtree(keyed / "inductor")
    torch.compiler.reset()
    third = _start(_config(cache_dir))
    try:
        info = third.report.compile
        assert info["artifacts_loaded"] is True
        assert info["cache"]["fxgraph_hit"] >= 1 and info["cache"]["fxgraph_miss"] == 0
        assert third.engine.runner.compiled_buckets == {32}
    finally:
        third.engine.shutdown(1.0)
        torch.compiler.reset()


def test_cache_directory_is_keyed_by_model_fingerprint_and_version(tmp_path):
    device = torch.device("cpu")

    def path(fingerprint="abc|float32|slot-kv-v1", version="1", slots=2, name="llm_engine"):
        return compile_cache_for(tmp_path, name, version, fingerprint, MODEL_DIR, slots, device).path

    assert path() == path()
    assert path().parent == tmp_path
    others = {
        path(fingerprint="def|float32|slot-kv-v1"),
        path(fingerprint="abc|bfloat16|slot-kv-v1"),
        path(version="2"),
        path(slots=4),
        path(name="other_model"),
    }
    assert path() not in others and len(others) == 5
    key = compile_cache_for(tmp_path, "llm_engine", "1", "abc", MODEL_DIR, 2, device).key
    assert key["torch"] == torch.__version__ and key["device"] == "cpu"


def test_checkpoint_with_another_tensor_layout_gets_another_directory(tmp_path):
    device = torch.device("cpu")
    copy = tmp_path / "model"
    shutil.copytree(MODEL_DIR, copy)
    same = compile_cache_for(tmp_path, "m", "1", "fp", copy, 2, device).path
    assert same == compile_cache_for(tmp_path, "m", "1", "fp", MODEL_DIR, 2, device).path
    (copy / "extra.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    assert compile_cache_for(tmp_path, "m", "1", "fp", copy, 2, device).path != same


def test_broken_compile_still_warms_and_counts_the_failure(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("inductor unavailable (test)")

    monkeypatch.setattr(torch, "compile", broken)
    loaded = _start(_config(tmp_path / "cache"))
    try:
        report = loaded.report
        assert [f["stage"].split(":")[0] for f in report.failures] == ["compile"]  # the metric's label
        assert "inductor unavailable" in report.failures[0]["error"]
        assert report.compile["compiled_buckets"] == [] and report.compile["eager_buckets"] == [32]
        assert not loaded.engine.runner.compiled_buckets
        names = [stage.name for stage in report.stages]
        assert {"compile", "prefill_buckets", "decode_kv_buckets", "requests"} <= set(names)
        assert len(_greedy(loaded, max_tokens=4)) == 4
    finally:
        loaded.engine.shutdown(1.0)
