"""A job run with an LLM_TENANT_SECRET that is not UTF-8 (bytes a shell passed through) must end with a
clear error and a failing exit code, as `generate` and `tenant-token` do, not with a traceback."""

import io
from pathlib import Path

import numpy as np

from client import warmup_job as wj


def test_job_with_a_secret_that_is_not_utf8_is_a_clear_error(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("LLM_TENANT_SECRET", "s\udcffs")
    log = tmp_path / "q.jsonl"
    log.write_text('{"prompt": "Where is my order?", "tenant": "acme"}\n')
    options = wj.JobOptions(
        log=log,
        templates=None,
        selection=wj.SelectionConfig(clusters=1, edge_cases=False),
        send=wj.SendConfig(url="127.0.0.1:1", progress=False, timeout_s=10),
    )
    out, err = io.StringIO(), io.StringIO()
    try:
        code = wj.run_job(options, out, err, embed=lambda texts: np.ones((len(texts), 4), np.float32))
    except Exception as exc:  # noqa: BLE001
        raise AssertionError(f"traceback instead of an error message: {exc!r}") from exc
    assert code != 0 and "UTF-8" in err.getvalue()
