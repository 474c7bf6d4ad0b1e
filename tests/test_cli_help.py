"""Every argparse command line of the repository answers --help.

argparse %-formats help strings, so a bare ``%`` in one (e.g. from an f-string's ``{x:.0%}``) makes
``--help`` crash with "TypeError: %o format: ..." although parsing works. Each CLI runs in a subprocess
as a user would start it (``python -m MODULE --help``); the modules are found by scanning the source, so a
new CLI is covered without listing it here.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("bench", "cache", "client", "deploy", "engine", "scheduler")
CLIENT_COMMANDS = ("generate", "warmup", "prime", "cache", "forget-tenant", "tenant-token")


def _cli_modules() -> list[str]:
    modules = []
    for package in PACKAGES:
        for path in sorted((REPO_ROOT / package).glob("*.py")):
            text = path.read_text()
            if "ArgumentParser(" not in text:
                continue
            if path.name == "__main__.py":
                modules.append(package)
            elif 'if __name__ == "__main__"' in text:
                modules.append(f"{package}.{path.stem}")
    return modules


def _help(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args, "--help"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_scan_finds_the_known_clis() -> None:
    found = set(_cli_modules())
    assert {"deploy.launch", "deploy.stop", "client", "client.load", "engine.build_model"} <= found
    assert {"cache.pair_training", "bench.prefix_cache", "bench.semantic_cache"} <= found


@pytest.mark.parametrize("module", _cli_modules())
def test_help_exits_0(module: str) -> None:
    result = _help(module)
    assert result.returncode == 0, result.stderr
    assert "usage:" in result.stdout
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("command", CLIENT_COMMANDS)
def test_client_command_help_exits_0(command: str) -> None:
    result = _help("client", command)
    assert result.returncode == 0, result.stderr
    assert "usage:" in result.stdout


def test_launch_help_shows_the_redis_maxmemory_default() -> None:
    result = _help("deploy.launch")
    assert result.returncode == 0, result.stderr
    assert "--redis-maxmemory" in result.stdout
    assert "25% of the" in " ".join(result.stdout.split())
