"""A server that refuses anonymous requests (LLM_TENANT_ANONYMOUS=false, with the suite's tenant secret):
it still loads (Triton's warmup samples and the steps' own warmups carry no token and are exempt), refuses
a request without a token through the ensemble and straight to the engine, and serves `default` with its
token."""

from __future__ import annotations

import pytest

from client.generate import GenerationError, generate
from scheduler.tenant_auth import ANONYMOUS_ENV, token_from_env
from tests.conftest import warm_stack
from tests.test_server_serving import engine_tokens

SAMPLING = {"max_tokens": 4, "ignore_eos": True}


@pytest.fixture(scope="module")
def signed_only_stack(tmp_path_factory):
    with warm_stack(tmp_path_factory.mktemp("signed-only"), **{ANONYMOUS_ENV: "false"}) as stack:
        yield stack


def test_a_request_without_a_token_is_refused_and_defaults_token_is_served(signed_only_stack):
    url = signed_only_stack.grpc_url
    with pytest.raises(GenerationError, match=ANONYMOUS_ENV):
        generate(url, "Who may ask?", sampling=SAMPLING, tenant_token="")  # `default`, unsigned ("": none)
    assert generate(url, "Who may ask?", sampling=SAMPLING, tenant="default").text  # the helper signs it
    assert generate(url, "Who may ask?", sampling=SAMPLING, tenant="acme").text


def test_the_engine_refuses_an_unsigned_request_sent_to_it_directly(signed_only_stack):
    params = {"max_tokens": 3, "temperature": 0.0, "ignore_eos": True}
    with pytest.raises(AssertionError, match=ANONYMOUS_ENV):
        engine_tokens(signed_only_stack.grpc_url, [1, 200, 300], params)
    signed = {**params, "tenant": "default", "tenant_token": token_from_env("default")}
    assert engine_tokens(signed_only_stack.grpc_url, [1, 200, 300], signed)
