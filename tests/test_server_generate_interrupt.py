"""Ctrl-C during `python -m client generate` mid-stream is an error line and exit 130, not a traceback
(found in review, 2026-12-07)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO_ROOT


def test_ctrl_c_mid_stream_is_an_error_line_not_a_traceback(grpc_url):
    argv = ["generate", "--url", grpc_url, "--max-tokens", "512", "--ignore-eos", "--timeout", "300"]
    proc = subprocess.Popen(
        [sys.executable, "-u", "-m", "client", *argv, "--cache", "bypass", "tell me a long story"],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        first = proc.stdout.read(1)  # the first piece arrived: mid-stream
        assert first, proc.stderr.read()
        time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        try:
            rc = proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pytest.fail("generate still running 15 s after Ctrl-C")
        err = proc.stderr.read().decode()
        assert "Traceback" not in err, err
        assert rc == 130 and "error: interrupted" in err, (rc, err)
    finally:
        if proc.poll() is None:
            proc.kill()
