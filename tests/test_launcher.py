"""deploy.launch without a server: config.pbtxt rendering, ports, metrics parsing."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from conftest import parse_metrics

from client.metrics import holds_requests
from deploy.launch import (
    _parse_param,
    find_free_port,
    get_parameters,
    render_repository,
    set_parameters,
)

ENGINE_CFG = """# the engine # parameters { key: "commented" }
name: "llm_engine"
backend: "python"
input [ { name: "input_ids" data_type: TYPE_INT64 dims: [ -1 ] } ]
parameters { key: "model_dir" value: { string_value: "${LLM_MODEL_DIR:-}" } }
parameters: {
  key: "warmup"
  value: { string_value: "true" }
}
"""


def _repo(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    texts = {
        "llm": 'name: "llm"\nplatform: "ensemble"\n',
        "llm_engine": ENGINE_CFG,
        "slo_scheduler": 'name: "slo_scheduler"\nbackend: "python"\n',
        "detokenizer": 'name: "detokenizer"\nbackend: "python"\n'
        'parameters { key: "x" value: { string_value: "a \\"quoted\\" {brace}" } }\n',
    }
    for name, text in texts.items():
        (src / name / "1").mkdir(parents=True)
        (src / name / "config.pbtxt").write_text(text)
        (src / name / "1" / "model.py").write_text("# model\n")
    (src / "llm" / "1" / "model.py").unlink()
    (src / "llm" / "1" / ".gitkeep").write_text("")
    return src


def _params(dst: Path, model: str) -> dict[str, str]:
    return get_parameters((dst / model / "config.pbtxt").read_text())


def test_override_replaces_existing_and_appends_new(tmp_path: Path) -> None:
    src = _repo(tmp_path)
    dst = render_repository(
        src, tmp_path / "dst", {"llm_engine": {"model_dir": "/abs/model", "warmup": "false", "new_key": "v"}}
    )
    text = (dst / "llm_engine" / "config.pbtxt").read_text()
    assert _params(dst, "llm_engine") == {"model_dir": "/abs/model", "warmup": "false", "new_key": "v"}
    assert text.count('key: "model_dir"') == 1 and text.count('key: "warmup"') == 1
    assert "${LLM_MODEL_DIR:-}" not in text
    assert 'parameters { key: "commented" }' in text  # comments untouched
    assert 'input [ { name: "input_ids"' in text
    # the source is never modified
    assert (src / "llm_engine" / "config.pbtxt").read_text() == ENGINE_CFG


def test_wildcard_and_model_specific_overrides(tmp_path: Path) -> None:
    dst = render_repository(
        _repo(tmp_path),
        tmp_path / "dst",
        {
            "*": {"model_dir": "/m", "redis_url": "redis://h:1/0"},
            "detokenizer": {"redis_url": "redis://other:2/0"},
        },
    )
    for model in ("llm", "llm_engine", "slo_scheduler"):
        p = _params(dst, model)
        assert p["model_dir"] == "/m" and p["redis_url"] == "redis://h:1/0"
    assert _params(dst, "detokenizer") == {
        "x": 'a "quoted" {brace}',
        "model_dir": "/m",
        "redis_url": "redis://other:2/0",
    }
    assert (dst / "llm" / "1" / ".gitkeep").exists()
    assert (dst / "llm_engine" / "1" / "model.py").exists()


def test_text_env_only_on_text_models(tmp_path: Path) -> None:
    dst = render_repository(_repo(tmp_path), tmp_path / "dst", {}, text_env="/opt/text_env")
    assert _params(dst, "slo_scheduler")["EXECUTION_ENV_PATH"] == "/opt/text_env"
    assert _params(dst, "detokenizer")["EXECUTION_ENV_PATH"] == "/opt/text_env"
    assert "EXECUTION_ENV_PATH" not in _params(dst, "llm_engine")
    assert "EXECUTION_ENV_PATH" not in _params(dst, "llm")


def test_no_text_env_no_execution_env(tmp_path: Path) -> None:
    dst = render_repository(_repo(tmp_path), tmp_path / "dst", {})
    for model in ("llm", "llm_engine", "slo_scheduler", "detokenizer"):
        assert "EXECUTION_ENV_PATH" not in (dst / model / "config.pbtxt").read_text()


def test_render_replaces_previous_output(tmp_path: Path) -> None:
    src = _repo(tmp_path)
    dst = tmp_path / "dst"
    render_repository(src, dst, {"llm_engine": {"a": "1"}})
    (dst / "stale.txt").write_text("old")
    render_repository(src, dst, {"llm_engine": {"a": "2"}})
    assert not (dst / "stale.txt").exists()
    assert _params(dst, "llm_engine")["a"] == "2"


def test_unknown_model_override_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown model"):
        render_repository(_repo(tmp_path), tmp_path / "dst", {"llm_engin": {"a": "1"}})


def test_set_parameters_escapes_and_dedups() -> None:
    text = (
        'name: "m"\nparameters { key: "k" value: { string_value: "1" } }\n'
        'parameters { key: "k" value: { string_value: "2" } }\n'
    )
    out = set_parameters(text, {"k": 'C:\\dir "x"'})
    assert out.count('key: "k"') == 1
    assert get_parameters(out) == {"k": 'C:\\dir "x"'}


def test_real_repository_renders(tmp_path: Path) -> None:
    src = Path(__file__).resolve().parents[1] / "model_repository"
    if not list(src.glob("*/config.pbtxt")):
        pytest.skip("model_repository has no models yet")
    dst = render_repository(src, tmp_path / "dst", {"*": {"model_dir": "/m"}}, text_env="/t")
    for cfg in dst.glob("*/config.pbtxt"):
        assert get_parameters(cfg.read_text())["model_dir"] == "/m"


def test_find_free_port_is_bindable() -> None:
    port = find_free_port()
    assert 1024 <= port <= 65535
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", port))


def test_find_free_port_skips_a_listening_port() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        assert all(find_free_port() != taken for _ in range(20))


def test_parse_param() -> None:
    assert _parse_param("llm_engine.warmup=off") == ("llm_engine", "warmup", "off")
    assert _parse_param("*.redis_url=redis://h:1/0") == ("*", "redis_url", "redis://h:1/0")
    with pytest.raises(Exception, match="model.key=value"):
        _parse_param("warmup=off")


def test_parse_metrics() -> None:
    text = """# HELP nv_inference_count Number of inferences
# TYPE nv_inference_count counter
nv_inference_count{model="llm",version="1"} 12
nv_gpu_utilization 0.5
weird{label="a b}c"} +Inf 1700000000
"""
    m = parse_metrics(text)
    assert m['nv_inference_count{model="llm",version="1"}'] == 12.0
    assert m["nv_gpu_utilization"] == 0.5
    assert m['weird{label="a b}c"}'] == float("inf")


def test_warmup_off_strips_model_warmup_blocks(tmp_path):
    from deploy.launch import REPO_ROOT, remove_model_warmup, render_repository

    warmup = 'model_warmup [ { name: "a" inputs { key: "x" value: { dims: [ 1 ] } } } ]'
    text = f'name: "m"\n{warmup}\nparameters {{ }}\n'
    assert remove_model_warmup(text) == 'name: "m"\n\nparameters { }\n'
    out = render_repository(REPO_ROOT / "model_repository", tmp_path / "repo", strip_model_warmup=True)
    assert all("model_warmup" not in p.read_text() for p in out.glob("*/config.pbtxt"))
    kept = render_repository(REPO_ROOT / "model_repository", tmp_path / "repo2")
    assert "model_warmup" in (kept / "llm_engine" / "config.pbtxt").read_text()


def test_a_drain_waits_on_the_engine_and_on_requests_triton_holds_for_a_step():
    assert holds_requests(parse_metrics('llm_engine_active_requests{model="llm_engine"} 1'))
    assert holds_requests(
        parse_metrics('nv_inference_pending_request_count{model="detokenizer",version="1"} 3')
    )
    assert not holds_requests(parse_metrics('llm_engine_queue_depth{model="llm_engine"} 0'))
    assert not holds_requests(parse_metrics('llm_engine_steps_total{model="llm_engine",kind="decode"} 812'))
    assert not holds_requests(parse_metrics("# HELP llm_engine_active_requests Requests holding a slot"))
