"""The operator CLI's failure paths: a clear `error:` line and an exit code (2: the arguments or inputs,
1: the server or Redis), never a traceback, and nothing done that looks like success when it was not."""

from __future__ import annotations

from scheduler.tenant_auth import SECRET_ENV

import dataclasses

import contextlib
import http.server
import io
import socketserver
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from client import load as load_cli
from client import warmup_job as wj
from client.__main__ import main
from tests.test_cache_report import SCRAPE
from tests.test_warmup_job import _write_log, fixed_log, topic_embed


def run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(argv, out, err)
    return code, out.getvalue(), err.getvalue()


@contextlib.contextmanager
def not_http(reply: bytes = b"\x00\x00\x12\x04\x00\x00\x00\x00\x00") -> Iterator[str]:
    """A port that answers what a gRPC port answers an HTTP GET: not HTTP."""

    class Handler(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            with contextlib.suppress(OSError):
                self.request.recv(65536)
                self.request.sendall(reply)

    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]])
def test_forget_tenant_with_a_url_redis_cannot_read_is_an_argument_error(dry_run: list[str]) -> None:
    code, _, err = run(["forget-tenant", "acme", "--redis-url", "localhost:6379", *dry_run])
    assert code == 2 and err.startswith("error:") and "scheme" in err


@pytest.mark.parametrize("name", ["a*", "Acme Corp", "acme "])
def test_forget_tenant_refuses_a_name_no_server_accepts(name: str) -> None:
    """'deleted 0 keys' for a typo or a pasted trailing space read as an erasure done, while the real
    tenant's data stayed."""
    code, out, err = run(["forget-tenant", name, "--redis-url", "redis://127.0.0.1:1/0"])
    assert code == 2 and "tenant" in err and not out


def test_a_metrics_port_that_does_not_answer_http_is_a_clear_error() -> None:
    """The gRPC port typed for the metrics one: http.client's BadStatusLine escaped as a traceback."""
    with not_http() as url:
        code, _, err = run(["cache", "--metrics-url", url])
        warned = io.StringIO()
        wj.print_cache_tiers(url, io.StringIO(), warned)  # the warmup job, after sending everything
    assert code == 1 and err.startswith(f"error: cannot read {url}") and "did not answer HTTP" in err
    assert "warning: cannot read the cache tiers" in warned.getvalue()


def test_cache_with_a_redis_url_it_cannot_read_is_an_argument_error() -> None:
    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = SCRAPE.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        code, _, err = run(["cache", "--metrics-url", url, "--redis-url", "localhost:6379"])
    finally:
        server.shutdown()
        server.server_close()
    assert code == 2 and err.startswith("error:")


@pytest.mark.parametrize(
    "option",
    [["--concurrency", "0"], ["--concurrency", "-1"], ["--max-tokens", "0"], ["--timeout", "-5"],
     ["--max-prompt-tokens", "0"]],
)  # fmt: skip
def test_warmup_options_out_of_range_are_refused_before_anything_runs(
    tmp_path: Path, option: list[str], capsys: pytest.CaptureFixture
) -> None:
    """A dry run is how an operator checks a CronJob's arguments; it took values the real run crashed on
    after embedding the log (--concurrency 0), or that failed every request or selected nothing."""
    log = _write_log(tmp_path / "q.jsonl", fixed_log())
    with pytest.raises(SystemExit) as exited:
        main(["warmup", "--log", str(log), "--dry-run", "--no-progress", *option])
    assert exited.value.code == 2 and option[0].lstrip("-").split("-")[0] in capsys.readouterr().err


def test_a_template_with_half_an_emoji_is_a_templates_error(tmp_path: Path) -> None:
    templates = tmp_path / "t.yaml"
    templates.write_text(
        'scenarios:\n  - scenario: emoji\n    tenant: acme\n    prompt: "My parcel \\ud83d"\n'
    )
    with pytest.raises(ValueError, match=r"scenarios\[0\]: 'prompt' is not valid UTF-8"):
        wj.load_templates(templates)


def test_a_templates_file_that_gives_scenarios_twice_is_refused(tmp_path: Path) -> None:
    """YAML keeps the last of two equal keys: the first list's SLO templates were dropped without a word."""
    templates = tmp_path / "t.yaml"
    templates.write_text(
        "scenarios:\n  - {scenario: checkout, tenant: acme, prompt: Pay for my order}\n"
        "scenarios:\n  - {scenario: login, tenant: acme, prompt: I cannot log in}\n"
    )
    with pytest.raises(yaml.YAMLError, match="duplicate key 'scenarios'"):
        wj.load_templates(templates)


def test_a_query_log_with_lines_but_no_usable_record_fails_the_job(tmp_path: Path) -> None:
    """A log shipper that changed format: nothing selected, nothing sent, and exit 0 told the CronJob
    all was well while the peak met cold caches."""
    log = tmp_path / "q.jsonl"
    log.write_text("garbage\n" + '{"text": "hello", "tenant": "acme"}\n' * 3)
    options = wj.JobOptions(
        log=log,
        templates=None,
        selection=wj.SelectionConfig(),
        send=wj.SendConfig(url="localhost:1", progress=False),
    )
    err = io.StringIO()
    assert wj.run_job(options, io.StringIO(), err, embed=topic_embed) == 2
    assert "none of the 4 lines" in err.getvalue()
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    plain = wj.SelectionConfig(edge_cases=False)
    quiet = wj.JobOptions(log=empty, templates=None, selection=plain, send=options.send, dry_run=True)
    out = io.StringIO()
    assert wj.run_job(quiet, out, io.StringIO(), embed=topic_embed) == 0  # nothing logged yet: no failure
    assert "selected 0 warmup items" in out.getvalue() and "| #" in out.getvalue()  # an empty table
    out = io.StringIO()  # with the default edge cases: only the synthetic ones, which need no log
    assert wj.run_job(dataclasses.replace(quiet, selection=wj.SelectionConfig()), out, io.StringIO()) == 0
    rows = [line for line in out.getvalue().splitlines() if line.startswith("| ") and "reason" not in line]
    assert rows and all("| edge_case " in row for row in rows if not row.startswith("|--")), rows


@pytest.mark.parametrize("limit", ["0", "-1"])
def test_the_load_generator_refuses_a_bad_concurrency_limit(limit: str) -> None:
    err = io.StringIO()
    code = load_cli.main(
        ["--count", "2", "--url", "localhost:1", "--concurrency-limit", limit], io.StringIO(), err
    )
    assert code == 2 and "--concurrency-limit must be >= 1" in err.getvalue()


def test_generate_cli_with_a_prompt_that_is_not_utf8_is_a_clear_error(monkeypatch):
    """A shell argument that is not UTF-8 reaches argv as a lone surrogate (surrogateescape): an error
    and exit status 1, not a traceback (found in review, 2026-12-07)."""
    from client.__main__ import main as client_main

    monkeypatch.delenv(SECRET_ENV, raising=False)
    out, err = io.StringIO(), io.StringIO()
    rc = client_main(["generate", "caf\udce9", "--url", "localhost:1", "--timeout", "2"], out, err)
    assert rc == 1 and "not UTF-8" in err.getvalue()
