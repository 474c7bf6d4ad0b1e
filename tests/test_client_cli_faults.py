"""The client CLI against bad arguments, found in review (2026-12-07): a NaN timeout, a tokenizer that
cannot be read, a Unicode digit, a URL or secret that is not UTF-8: usage errors, never a traceback or a
busy loop."""

from __future__ import annotations

import importlib
import io
import threading

import pytest

from tests.test_load_faults import NeverAnsweringClient

# the modules, not the package attributes of the same names
cli = importlib.import_module("client.__main__")
gen = importlib.import_module("client.generate")
wj = importlib.import_module("client.warmup_job")


def run_cli(argv):
    out, err = io.StringIO(), io.StringIO()
    try:
        rc = cli.main(argv, out, err)
    except SystemExit as exc:
        rc = exc.code
    return rc, out.getvalue(), err.getvalue()


def test_clusters_unicode_digit_is_usage_error_not_traceback(tmp_path):
    log = tmp_path / "log.jsonl"
    log.write_text('{"prompt": "hi", "tenant": "a"}\n')
    try:
        rc, _, _ = run_cli(["warmup", "--log", str(log), "--clusters", "\u00b2", "--dry-run", "--url", "x:1"])
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"traceback instead of a usage error: {exc!r}")
    assert rc == 2


@pytest.mark.parametrize("kind", ["not_json", "directory"])
def test_unreadable_tokenizer_exits_2(tmp_path, kind):
    log = tmp_path / "log.jsonl"
    log.write_text('{"prompt": "hi", "tenant": "a"}\n')
    if kind == "not_json":
        tok = tmp_path / "tokenizer.json"
        tok.write_text("this is not json")
    else:
        tok = tmp_path
    try:
        rc, _, err = run_cli(
            [
                "warmup",
                "--log",
                str(log),
                "--tokenizer",
                str(tok),
                "--dry-run",
                "--url",
                "x:1",
                "--no-progress",
            ]
        )
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"traceback instead of exit 2: {exc!r}")
    assert rc == 2 and "error" in err


def test_warmup_non_utf8_url_is_clear_error(tmp_path):
    log = tmp_path / "log.jsonl"
    log.write_text('{"prompt": "hi", "tenant": "a"}\n')
    with pytest.raises(ValueError, match="UTF-8"):  # refused when the options are read, dry run included
        wj.SendConfig(url="local\udcffhost:1", timeout_s=1.0, progress=False)
    rc, _, _ = run_cli(["warmup", "--log", str(log), "--dry-run", "--url", "local\udcffhost:1"])
    assert rc == 2


def test_prime_non_utf8_url_is_clear_error(capsys):
    try:
        rc, _, _ = run_cli(["prime", "--url", "local\udcffhost:1"])
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"traceback instead of an error exit: {exc!r}")
    assert rc == 2 and "not UTF-8" in capsys.readouterr().err


def _cli_in_thread(argv, seconds=5.0):
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("r", run_cli(argv)), daemon=True)
    t.start()
    t.join(seconds)
    return t.is_alive(), box.get("r")


@pytest.mark.parametrize("command", ["prime", "generate"])
def test_nan_timeout_does_not_spin_forever(monkeypatch, command):
    """--timeout nan is accepted; StreamingSession.wait then busy-loops forever (remaining=nan is never
    <= 0 and Condition.wait(nan) returns at once) when the server does not answer."""
    monkeypatch.setattr(gen.grpcclient, "InferenceServerClient", NeverAnsweringClient)
    monkeypatch.setattr(
        cli.grpcclient,
        "InferenceServerClient",
        type("Ready", (NeverAnsweringClient,), {"is_model_ready": lambda self, m: True}),
    )
    argv = (
        ["prime", "--url", "x:1", "--timeout", "nan"]
        if command == "prime"
        else ["generate", "--url", "x:1", "--timeout", "nan", "hi"]
    )
    hung, result = _cli_in_thread(argv)
    assert not hung, f"{command} --timeout nan hangs (busy loop) instead of a usage error"
    assert result[0] == 2


def test_tenant_token_non_utf8_secret(monkeypatch):
    monkeypatch.setenv("LLM_TENANT_SECRET", "s\udcffs")
    try:
        rc, _, err = run_cli(["tenant-token", "acme"])
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"traceback: {exc!r}")
    assert rc == 2


@pytest.mark.parametrize("command", ["prime", "generate"])
def test_a_secret_that_is_not_utf8_is_refused_before_any_request(monkeypatch, command):
    """Every request's tenant token is signed with the secret's UTF-8 bytes: refused up front, named."""
    monkeypatch.setenv("LLM_TENANT_SECRET", "s\udcffs")
    argv = ["prime", "--url", "x:1"] if command == "prime" else ["generate", "--url", "x:1", "hi"]
    rc, _, err = run_cli(argv)
    assert rc == 2 and "LLM_TENANT_SECRET is not UTF-8 text" in err
