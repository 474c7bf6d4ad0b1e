"""README.md claims checked against the code: gaps in tests/test_readme_matches_code.py found in review
(2026-12-07): parameters missing from the engine's lists, where the launcher's tenant secret is found, and
the cancel latency of non-streaming and direct requests."""

from __future__ import annotations

import json
import re
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def _env_section() -> str:
    return README.split("Environment variables read by the `config.pbtxt` files", 1)[1].split(
        "The cache tiers at a glance", 1
    )[0]


def _model_env(model: str) -> dict[str, str]:
    """{LLM_VAR: parameter} that model's config.pbtxt reads."""
    text = (REPO / "model_repository" / model / "config.pbtxt").read_text()
    pairs = re.findall(r'key: "([a-z0-9_]+)" value: \{ string_value: "\$\{(LLM_[A-Z0-9_]+)', text)
    return {env: param for param, env in pairs}


def test_each_models_environment_list_names_what_its_config_reads() -> None:
    """README line ~268: 'Engine (`llm_engine`): ...' lists the variables llm_engine reads; the engine's
    config.pbtxt also reads LLM_PROMPT_SPECIAL_TOKENS (prompt_special_tokens, for its templates)."""
    env = _env_section()
    sections = {
        "llm_engine": env.split("Engine (`llm_engine`):", 1)[1].split("Scheduler step (`slo_scheduler`):", 1)[
            0
        ],
        "slo_scheduler": env.split("Scheduler step (`slo_scheduler`):", 1)[1].split("Detokenizer:", 1)[0],
        "detokenizer": env.split("Detokenizer:", 1)[1].split("The tenant settings", 1)[0],
    }
    missing = {
        model: sorted(name for name in _model_env(model) if f"`{name}`" not in text)
        for model, text in sections.items()
    }
    assert not any(missing.values()), f"README's per-model environment lists lack: {missing}"


def test_engine_parameter_list_names_every_engine_parameter() -> None:
    """README 'Engine parameters (`model_repository/llm_engine/config.pbtxt`, ...)' is the engine's list;
    `prompt_special_tokens` appears only under the scheduler step."""
    from dataclasses import fields

    from engine.config import EngineConfig

    section = README.split("Engine parameters (`model_repository/llm_engine/config.pbtxt`", 1)[1].split(
        "Environment variables read by", 1
    )[0]
    missing = [f.name for f in fields(EngineConfig) if f.name != "extra" and f"`{f.name}`" not in section]
    assert not missing, f"the engine parameter list lacks {missing}"


def test_stack_secret_is_found_only_for_the_default_run_dir_and_readme_says_so(tmp_path) -> None:
    """README ~984-987: a launcher-made secret '<run_dir>/tenant_secret ...: the `python -m client` tools
    sent to that stack sign with it'. The tools look only in .run/main/stack.json
    (client/stack_defaults.py STACK_FILE, signing_for): a stack started with another --run-dir is not
    found, so `client prime` / `client warmup` (restricted tier warmup) and `generate --tenant X` sent to
    it carry no token and are refused INVALID_ARG. README must say how to sign for such a stack."""
    from client.stack_defaults import STACK_FILE, stack_secret

    # the code's behaviour: a live stack recorded in another run dir is not found by the default lookup
    me = psutil.Process()
    (tmp_path / "tenant_secret").write_text("s3cret\n")
    record = {
        "grpc_url": "localhost:59999",
        "pids": {"tritonserver": me.pid},
        "create_times": {"tritonserver": me.create_time()},
        "tenant_secret_file": str(tmp_path / "tenant_secret"),
    }
    (tmp_path / "stack.json").write_text(json.dumps(record))
    assert stack_secret("localhost:59999", tmp_path / "stack.json") == "s3cret"  # found when pointed at it
    assert STACK_FILE == REPO / ".run" / "main" / "stack.json"  # ...but the CLI only ever reads this one
    # the README: the other-run-dir advice (line ~53) or the tenants paragraph must name the secret file
    other = README.split("For a stack in another run directory", 1)[1].split("\n\n", 1)[0]
    tenants = README.split("gives its stack\n  a secret of its own", 1)[1].split("A gateway", 1)[0]
    assert "tenant_secret" in other or ".run/main" in tenants, (
        "README says the client tools sign for the launcher's stack, but they only find the secret of a "
        "stack in .run/main"
    )


def test_known_limits_cancel_latency_covers_non_streaming_and_direct_requests() -> None:
    """README ~829: 'A cancel is noticed within ~50 ms plus a step'. That is the detokenizer's poll
    (engine/cancel_poll.py CANCEL_POLL_S) on a stream's pieces; a non-streaming request's pieces come only
    every NON_STREAM_KEEPALIVE_S (engine/engine.py), and a direct llm_engine request is asked every
    ENGINE_CANCEL_POLL_S: both ~0.25 s, not 50 ms."""
    from engine.cancel_poll import CANCEL_POLL_S, ENGINE_CANCEL_POLL_S
    from engine.engine import NON_STREAM_KEEPALIVE_S

    assert CANCEL_POLL_S == 0.05 and NON_STREAM_KEEPALIVE_S == 0.25 and ENGINE_CANCEL_POLL_S == 0.25
    bullet = README.split("cancel is noticed within", 1)[1].split("\n- ", 1)[0]
    assert "0.25 s" in bullet, "the cancel-latency bullet states 50 ms for every request"
