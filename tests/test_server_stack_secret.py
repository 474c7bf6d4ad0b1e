"""A stack started without LLM_TENANT_SECRET (deploy/stack_secret.py): its server, which without a
secret would serve tenant `default` only, gets a secret of the stack's own; `default` is served unsigned,
a named tenant only with a token of that secret (a token of another secret is refused), and the client
tools sent to the stack sign with it."""

from __future__ import annotations

import io
import json
import stat

import pytest

from client import stack_defaults
from client.__main__ import main as client_main
from client.generate import GenerationError, generate
from deploy.stack_secret import read_tenant_secret
from scheduler.tenant_auth import SECRET_ENV, token_from_env
from tests.conftest import warm_stack

SAMPLING = {"max_tokens": 3, "ignore_eos": True}


@pytest.fixture(scope="module")
def own_secret_stack(tmp_path_factory):
    with warm_stack(tmp_path_factory.mktemp("own-secret"), **{SECRET_ENV: ""}) as stack:
        yield stack


def test_the_stack_keeps_its_secret_in_a_file_only_its_owner_reads(own_secret_stack):
    path = own_secret_stack.tenant_secret_file
    assert path is not None and stat.S_IMODE(path.stat().st_mode) == 0o600
    recorded = json.loads((own_secret_stack.run_dir / "stack.json").read_text())
    assert recorded["tenant_secret_file"] == str(path) and read_tenant_secret(path)


def test_named_tenants_need_a_token_of_the_stacks_secret(own_secret_stack):
    url, secret = own_secret_stack.grpc_url, read_tenant_secret(own_secret_stack.tenant_secret_file)
    assert generate(url, "Who may ask?", sampling=SAMPLING, tenant_token="").text  # `default`, unsigned
    foreign = token_from_env("acme")  # the suite's own secret: not this stack's
    with pytest.raises(GenerationError, match="tenant_token"):
        generate(url, "Who may ask?", sampling=SAMPLING, tenant="acme", tenant_token=foreign)
    own = token_from_env("acme", {SECRET_ENV: secret})
    assert generate(url, "Who may ask?", sampling=SAMPLING, tenant="acme", tenant_token=own).text


def test_the_client_tools_sent_to_the_stack_sign_with_its_secret(own_secret_stack, monkeypatch):
    monkeypatch.delenv(SECRET_ENV)
    monkeypatch.setattr(stack_defaults, "STACK_FILE", own_secret_stack.run_dir / "stack.json")
    out, err = io.StringIO(), io.StringIO()
    argv = [
        "generate",
        "Who may ask?",
        "--url",
        own_secret_stack.grpc_url,
        "--tenant",
        "acme",
        "--max-tokens",
        "2",
    ]
    assert client_main(argv, out, err) == 0, err.getvalue()
