"""The warmup job's inputs, found in review (2026-12-07): a misspelled template key warmed tenant 'default'
silently; a log's UTF-8 byte order mark cost its first record; the tokenizer count read a typed `</s>` as
one token where the server (prompt_special_tokens=text) reads several; a template over the prompt limit
passed the dry run and was refused by the server."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest

from client import warmup_job as wj

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "models" / "tiny-llama" / "tokenizer.json"


def _embed(texts: list[str]) -> np.ndarray:
    return np.ones((len(texts), 4), dtype=np.float32)


def _dry(log: Path, templates: Path | None = None, **selection: object) -> wj.JobOptions:
    return wj.JobOptions(
        log=log, templates=templates, dry_run=True,
        selection=wj.SelectionConfig(clusters=1, edge_cases=False, **selection),
        send=wj.SendConfig(url="localhost:1", progress=False),
    )  # fmt: skip


# ---- Bug 1: a misspelled key in a template entry is silently ignored (tenant falls back to 'default')
def test_a_misspelled_template_key_is_an_error_not_a_silent_default(tmp_path: Path) -> None:
    path = tmp_path / "t.yaml"
    path.write_text(
        "scenarios:\n"
        "  - scenario: checkout_assistant\n"
        "    tennant: acme\n"  # typo: the template would warm tenant 'default', acme's prefix stays cold
        "    prompt: You are the checkout assistant of ACME.\n",
        encoding="utf-8",
    )
    with pytest.raises(ValueError, match="tennant"):
        wj.load_templates(path)
    log = tmp_path / "q.jsonl"
    log.write_text('{"prompt": "hi there", "tenant": "acme"}\n', encoding="utf-8")
    out, err = io.StringIO(), io.StringIO()
    assert wj.run_job(_dry(log, path), out, err, embed=_embed) == 2
    assert "tennant" in err.getvalue()


def test_the_shipped_templates_still_load() -> None:
    assert len(wj.load_templates(REPO / "data" / "slo_templates.yaml")) == 4  # merge keys: test_warmup_job


# ---- Bug 2: a UTF-8 byte order mark at the start of the log drops its first record
def test_a_log_starting_with_a_utf8_bom_keeps_its_first_record(tmp_path: Path) -> None:
    records = [
        {"prompt": "Where is my refund?", "tenant": "acme"},
        {"prompt": "Reset my password", "tenant": "acme"},
    ]
    path = tmp_path / "q.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b"".join(json.dumps(r).encode() + b"\r\n" for r in records))
    log = wj.read_query_log(path)
    assert log.malformed == () and log.records == 2
    assert {s.text for s in log.stats} == {"Where is my refund?", "Reset my password"}
    # as str lines too (the parse_query_log API takes either)
    text_log = wj.parse_query_log(["\ufeff" + json.dumps(records[0])])
    assert text_log.records == 1 and text_log.malformed == ()


def test_a_bom_inside_the_log_is_still_malformed() -> None:
    log = wj.parse_query_log([json.dumps({"prompt": "a"}), "\ufeff" + json.dumps({"prompt": "b"})])
    assert log.records == 1 and [m.line_no for m in log.malformed] == [2]


# ---- Bug 3: --tokenizer counts special-token text ("</s>") as one token; the server (prompt_special_tokens
# = text, the default) counts its characters, so prompts the job judges to fit are rejected by the server
def _server_count() -> object:
    from tokenizers import Tokenizer

    from scheduler.tokenize import ids_encoder, treat_special_tokens

    tok = Tokenizer.from_file(str(TOKENIZER))
    treat_special_tokens(tok, "text")  # the server's default (config.pbtxt: LLM_PROMPT_SPECIAL_TOKENS:-text)
    return ids_encoder(tok)


def test_the_tokenizer_count_matches_the_servers_for_special_token_text() -> None:
    count = wj.token_counter(TOKENIZER)
    server = _server_count()
    prompt = "My template ends every turn with </s> and starts with <s>: why does it stop early? " * 5
    assert count(prompt) == len(server(prompt))


def test_a_log_prompt_over_the_servers_limit_is_left_out_with_the_tokenizer() -> None:
    count = wj.token_counter(TOKENIZER)
    server = _server_count()
    prompt = "Explain </s> please. " * 40
    limit = len(server(prompt)) - 1  # the server rejects it
    stats = wj.count_prompts([wj.LogRecord(prompt, "acme"), wj.LogRecord("Short one?", "acme")])
    config = wj.SelectionConfig(clusters=1, edge_cases=True, top_percent=100, max_prompt_tokens=limit)
    selection = wj.select_from_counts(stats, [], embed=_embed, config=config, count_tokens=count)
    assert selection.too_long == 1
    assert all(len(server(item.prompt)) <= limit for item in selection.items)


# ---- Bug 4: an SLO template longer than the server's prompt limit passes the dry run (exit 0, no word);
# the real run sends it, the server refuses it, and that scenario is never warm
def test_a_template_over_the_prompt_limit_fails_the_dry_run_with_an_exact_tokenizer(tmp_path: Path) -> None:
    log = tmp_path / "q.jsonl"
    log.write_text('{"prompt": "hi there", "tenant": "acme"}\n', encoding="utf-8")
    count = wj.token_counter(TOKENIZER)
    templates = wj.load_templates(REPO / "data" / "slo_templates.yaml")
    limit = min(count(t.prompt) for t in templates) - 1  # every shipped template is over it
    options = wj.JobOptions(
        log=log, templates=REPO / "data" / "slo_templates.yaml", dry_run=True, tokenizer=TOKENIZER,
        selection=wj.SelectionConfig(clusters=1, edge_cases=False, max_prompt_tokens=limit),
        send=wj.SendConfig(url="localhost:1", progress=False),
    )  # fmt: skip
    out, err = io.StringIO(), io.StringIO()
    assert wj.run_job(options, out, err, embed=_embed) == 2
    assert "checkout_assistant" in err.getvalue()


def test_without_a_tokenizer_an_over_limit_template_is_only_a_warning(tmp_path: Path) -> None:
    """The byte bound over-counts: a template it judges too long may fit, so that is no reason to stop."""
    log = tmp_path / "q.jsonl"
    log.write_text('{"prompt": "hi there", "tenant": "acme"}\n', encoding="utf-8")
    out, err = io.StringIO(), io.StringIO()
    options = _dry(log, REPO / "data" / "slo_templates.yaml", max_prompt_tokens=100)
    assert wj.run_job(options, out, err, embed=_embed) == 0
    assert "warning: template 'checkout_assistant'" in err.getvalue()
