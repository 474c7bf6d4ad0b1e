"""README.md names what the code accepts: every engine parameter, every environment variable a
config.pbtxt reads, every launcher and stop option (found by a fresh-user review: several were missing)."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

from engine.config import EngineConfig

REPO_ROOT = Path(__file__).resolve().parents[1]
README = (REPO_ROOT / "README.md").read_text()


def test_every_engine_parameter_is_documented() -> None:
    missing = [f.name for f in fields(EngineConfig) if f.name != "extra" and f"`{f.name}`" not in README]
    assert not missing, f"README.md does not name these engine parameters: {missing}"


def test_every_environment_variable_of_the_model_configs_is_documented() -> None:
    names = set()
    for config in (REPO_ROOT / "model_repository").glob("*/config.pbtxt"):
        names |= set(re.findall(r"\$\{(LLM_[A-Z0-9_]+)", config.read_text()))
    assert "LLM_MAX_BATCH" in names
    missing = sorted(name for name in names if f"`{name}`" not in README)
    assert not missing, f"README.md does not name these environment variables: {missing}"


def test_every_launcher_and_stop_option_is_in_the_synopsis() -> None:
    section = README.split("## Starting and stopping by hand", 1)[1].split("\n## ", 1)[0]
    synopsis = section.split("```", 2)[1]
    for module in ("launch", "stop"):
        source = (REPO_ROOT / "deploy" / f"{module}.py").read_text()
        options = re.findall(r"add_argument\(\s*\"(--[a-z-]+)\"", source)
        assert options, module
        missing = [option for option in options if option not in synopsis]
        assert not missing, f"the README synopsis lacks deploy.{module} options {missing}"
