"""A Redis reached over TLS (`rediss://`, as managed Redis services and encrypted in-cluster traffic
require), against a real redis-server with a certificate of a test CA: every client the engine and the
commands build connects through the CA the URL names, and a server the client cannot verify (no CA
given, or a client speaking plain RESP to the TLS port) is an unavailable cache, never a failed request."""

from __future__ import annotations

import shutil
import subprocess
import uuid

import pytest

from deploy.launch import find_free_port
from tests.test_cache_report import metrics_url  # noqa: F401  (the fixture)
from tests.test_redis_auth import (
    assert_unavailable_not_failing,
    check_the_commands,
    exercise_every_client,
    spawn_redis,
)

PASSWORD = "tls-" + uuid.uuid4().hex[:8]


def make_certificates(directory) -> dict[str, str]:
    """A test CA and a server certificate it signed for 127.0.0.1 (EC keys: fast to make)."""

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=test-ca",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign")  # fmt: skip
    openssl("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1")
    (directory / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "server.crt", "-days", "2", "-extfile", "san.ext")  # fmt: skip
    return {name: str(directory / f"{name}") for name in ("ca.crt", "server.crt", "server.key")}


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory):
    """A redis-server that speaks only TLS (no plain port) and wants PASSWORD; (URL with the CA, port, CA)."""
    if shutil.which("openssl") is None:
        pytest.fail("openssl not found: `make setup` installs it")
    run_dir = tmp_path_factory.mktemp("tls-redis")
    files = make_certificates(run_dir)
    port = find_free_port()
    url = f"rediss://:{PASSWORD}@127.0.0.1:{port}/0?ssl_ca_certs={files['ca.crt']}"
    args = ["--port", "0", "--tls-port", str(port), "--tls-cert-file", files["server.crt"],
            "--tls-key-file", files["server.key"], "--tls-ca-cert-file", files["ca.crt"],
            "--tls-auth-clients", "no", "--requirepass", PASSWORD]  # fmt: skip
    proc = spawn_redis(run_dir, args, url)
    yield url, port, files["ca.crt"]
    proc.terminate()
    proc.wait(timeout=10)


def test_every_cache_client_connects_over_tls(tls_redis):
    exercise_every_client(tls_redis[0])


@pytest.mark.parametrize(
    "make_url",
    [lambda port: f"rediss://:{PASSWORD}@127.0.0.1:{port}/0",  # the test CA is not among the system's
     lambda port: f"redis://:{PASSWORD}@127.0.0.1:{port}/0"],  # plain RESP to a TLS port
    ids=["unknown-ca", "plain-to-tls"],
)  # fmt: skip
def test_a_server_the_client_cannot_verify_is_an_unavailable_cache(tls_redis, make_url):
    last_error = assert_unavailable_not_failing(make_url(tls_redis[1]))
    assert last_error and PASSWORD not in last_error


def test_the_commands_work_over_tls(tls_redis, metrics_url):  # noqa: F811
    url, port, _ = tls_redis
    check_the_commands(url, f"rediss://:{PASSWORD}@127.0.0.1:{port}/0", metrics_url, PASSWORD)
