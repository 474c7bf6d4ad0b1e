"""A Redis password holding a character that must be percent-encoded in a URL (/ ? #: base64 and
generated passwords hold them) leaks into logs, the model-load error in tritonserver.log, stack.json and
the client CLI's output (found in review, 2026-12-07)."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest

from cache.response_cache import ExactResponseCache, make_redis_client, redact_url
from engine.loader import check_redis

FIRST, REST = "Pw1stHalfX", "Pw2ndHalfY"
URLS = [
    f"redis://:{FIRST}/{REST}@127.0.0.1:6379/0",  # base64 password with a '/'
    f"redis://:{FIRST}?{REST}@127.0.0.1:6379/0",
    f"redis://:{FIRST}#{REST}@127.0.0.1:6379/0",
    f"redis://user:{FIRST}/{REST}@127.0.0.1:6379/0?db=0",
]


@pytest.mark.parametrize("url", URLS)
def test_redact_url_hides_a_password_with_reserved_characters(url):
    shown = redact_url(url)
    assert FIRST not in shown and REST not in shown, shown


@pytest.mark.parametrize("url", URLS)
def test_engine_load_error_does_not_echo_the_password(url):
    """check_redis runs first in load_engine; its ValueError is the model-load error Triton logs."""
    lines: list[str] = []
    with pytest.raises(ValueError) as caught:
        check_redis(SimpleNamespace(redis_url=url), lines.append)
    text = str(caught.value) + "".join(lines)
    assert FIRST not in text and REST not in text, text


@pytest.mark.parametrize("url", URLS)
def test_cache_client_construction_error_does_not_echo_the_password(url):
    for build in (lambda: make_redis_client(url, 0.1), lambda: ExactResponseCache(url, "fp")):
        with pytest.raises(ValueError) as caught:
            build()
        assert FIRST not in str(caught.value) and REST not in str(caught.value), str(caught.value)


def test_client_cache_command_does_not_print_the_password(monkeypatch):
    from client import __main__ as cli

    monkeypatch.setattr(cli, "tier_rows", lambda metrics: [object()])
    monkeypatch.setattr(cli, "scrape_metrics", lambda url: "")
    out, err = io.StringIO(), io.StringIO()
    code = cli.main(
        ["cache", "--metrics-url", "http://127.0.0.1:1/metrics", "--redis-url", URLS[2]], out=out, err=err
    )
    printed = out.getvalue() + err.getvalue()
    assert code != 0
    assert FIRST not in printed and REST not in printed, printed
