"""Tenant authentication (scheduler/tenant_auth.py): with a server secret, a request acts as a named
tenant only with that tenant's token, in the scheduler step and in the engine (which Triton serves
directly too); without one, a server serves `default` only unless told to trust its clients."""

from __future__ import annotations

import io
import json
import time
import uuid
from pathlib import Path

import psutil
import pytest
import yaml

from cache.response_cache import ExactResponseCache
from client import stack_defaults
from tests.test_stack_defaults import write_stack
from client.__main__ import main as client_main
from client.generate import input_arrays
from scheduler.errors import RequestError
from scheduler.step import SchedulerStep
from scheduler.tenant_auth import (
    ANONYMOUS_ENV,
    PREVIOUS_SECRET_ENV,
    REQUIRE_EXPIRY_ENV,
    SECRET_ENV,
    TRUST_ENV,
    TenantAuth,
    tenant_token,
    token_from_env,
)
from scheduler.tiers import TierTable
from scheduler.validation import Limits
from tests.test_engine_batching import RecordingSink, make_engine, model, request, run_until_idle  # noqa: F401
from tests.conftest import answer

SECRET = b"a-server-secret"
FP = "0123456789abcdef|fedcba9876543210|float32|slot-kv-v1"


def step(auth: TenantAuth) -> SchedulerStep:
    return SchedulerStep(
        encode=lambda text, tenant: [1, *text.encode("utf-8")],
        limits=Limits(max_prompt_tokens=1000, max_new_tokens=64),
        tiers=TierTable.defaults(),
        exact_fingerprint=FP,
        tenant_auth=auth,
    )


def prepare_at(s: SchedulerStep, tenant: str | None, tier: str, token: str | bytes | None = None):
    return s.prepare("What did we decide?", '{"max_tokens": 8}', True, False, tier, tenant, time.time_ns(),
                     tenant_token=token)  # fmt: skip


def prepare(s: SchedulerStep, tenant: str | None, token: str | bytes | None = None):
    return s.prepare("What did we decide?", '{"max_tokens": 8}', True, False, None, tenant, time.time_ns(),
                     tenant_token=token)  # fmt: skip


class Clock:
    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_an_expiring_token_passes_until_its_expiry_and_names_it_when_refused():
    clock = Clock(1_800_000_000.0)
    auth = TenantAuth(SECRET, clock=clock)
    token = tenant_token(SECRET, "acme", 1_800_000_060)
    assert auth.check("acme", token) == token
    clock.now = 1_800_000_060.0
    with pytest.raises(RequestError) as info:
        auth.check("acme", token)
    assert info.value.code == "INVALID_ARG" and "expired at 2027-01-15 08:01:00 UTC" in info.value.message


@pytest.mark.parametrize(
    "forged",
    [
        "1900000000." + tenant_token(SECRET, "acme", 1_800_000_060).split(".")[1],  # expiry moved on
        tenant_token(SECRET, "acme", 1_800_000_060).split(".")[1],  # expiry dropped
        tenant_token(SECRET, "other", 1_900_000_000),
        tenant_token(b"guess", "acme", 1_900_000_000),
        "1.5." + "00" * 32,
        "-1." + "00" * 32,
        "9" * 40 + "." + "00" * 32,
        "." + tenant_token(SECRET, "acme"),
    ],
)
def test_an_expiry_cannot_be_moved_or_forged(forged):
    auth = TenantAuth(SECRET, clock=Clock(1_800_000_000.0))
    with pytest.raises(RequestError) as info:
        auth.check("acme", forged)
    assert "is not the token of tenant 'acme'" in info.value.message


HEX = tenant_token(SECRET, "acme", 1_900_000_000).split(".")[1]


@pytest.mark.parametrize(
    "token",
    [
        "\u00b2." + HEX,
        "\u2460." + HEX,
        "\u00b9" * 10 + "." + HEX,
        5,
        True,
        1.5,
        "\ud800",
        f"1900000000.{HEX[:-1]}\udc80",
    ],
)
def test_hostile_tokens_are_a_clear_request_error_never_an_internal_one(token):
    """Found in review: "²".isdigit() is true and int("²") raises; an int request parameter or a lone
    surrogate raised AttributeError / UnicodeEncodeError, which the scheduler turns into INTERNAL."""
    auth = TenantAuth(SECRET, clock=Clock(1_800_000_000.0))
    with pytest.raises(RequestError) as info:
        auth.check("acme", token)
    assert info.value.code == "INVALID_ARG"
    with pytest.raises(RequestError):
        prepare(
            step(auth), "acme", token.encode("utf-8", "surrogatepass") if isinstance(token, str) else token
        )


@pytest.mark.parametrize("tier", ["critical", "warmup"])
def test_a_restricted_tier_needs_a_token_default_included(tier):
    """Anonymous traffic may not jump the queue, nor write the caches at once as warmup traffic does."""
    tiers = TierTable.defaults()
    auth = TenantAuth(SECRET)
    with pytest.raises(RequestError) as info:
        auth.check("default", None, tiers.get(tier))
    assert info.value.code == "INVALID_ARG" and f"slo_tier {tier!r} is restricted" in info.value.message
    with pytest.raises(RequestError):
        prepare_at(step(auth), None, tier)
    with pytest.raises(RequestError):  # someone else's token does not open it either
        auth.check("default", tenant_token(SECRET, "acme", 1_900_000_000), tiers.get(tier))
    token = tenant_token(SECRET, "default", int(time.time()) + 60)
    assert prepare_at(step(auth), None, tier, token).params.tier == tier
    assert prepare_at(step(auth), "acme", tier, tenant_token(SECRET, "acme")).params.tier == tier
    assert prepare_at(step(TenantAuth()), None, tier).params.tier == tier  # no secret: open
    for open_tier in ("standard", "batch"):
        assert prepare_at(step(auth), None, open_tier).params.tenant_token == ""


def test_the_engine_refuses_a_direct_restricted_request_but_runs_its_own_warmup(model):  # noqa: F811
    engine = make_engine(model)
    engine.tenant_auth = TenantAuth(SECRET)
    with pytest.raises(RequestError) as info:
        engine.submit(request([1, 5, 6], RecordingSink(), "d", tier="critical"))
    assert "restricted" in info.value.message
    sink = RecordingSink()
    engine.submit(request([1, 5, 6], sink, "w", tier="warmup"), own=True)
    run_until_idle(engine)
    assert sink.finished and not sink.errors


def test_a_server_may_require_expiring_tokens():
    auth = TenantAuth.from_env({SECRET_ENV: SECRET.decode(), REQUIRE_EXPIRY_ENV: "1"})
    with pytest.raises(RequestError) as info:
        auth.check("acme", tenant_token(SECRET, "acme"))
    assert "has no expiry" in info.value.message and REQUIRE_EXPIRY_ENV in info.value.message
    expiring = token_from_env("acme", {SECRET_ENV: SECRET.decode()})
    assert auth.check("acme", expiring) == expiring  # the operator tools sign an expiry


def test_a_rotated_secret_keeps_its_tokens_until_it_is_dropped():
    old = tenant_token(SECRET, "acme", 1_900_000_000)
    rotating = TenantAuth.from_env({SECRET_ENV: "a-new-secret", PREVIOUS_SECRET_ENV: SECRET.decode()})
    rotating = TenantAuth(rotating.secret, rotating.previous, clock=Clock(1_800_000_000.0))
    new = tenant_token("a-new-secret", "acme", 1_900_000_000)
    assert rotating.check("acme", old) == old and rotating.check("acme", new) == new
    rotated = TenantAuth(b"a-new-secret", clock=Clock(1_800_000_000.0))
    assert rotated.check("acme", new) == new
    with pytest.raises(RequestError):
        rotated.check("acme", old)


def test_a_server_may_refuse_anonymous_requests_but_not_its_own():
    auth = TenantAuth.from_env({SECRET_ENV: SECRET.decode(), ANONYMOUS_ENV: "false"})
    with pytest.raises(RequestError) as info:
        prepare(step(auth), None)  # no tenant named: `default`, without a token
    assert ANONYMOUS_ENV in info.value.message and "tenant_token" in info.value.message
    signed = token_from_env("default", {SECRET_ENV: SECRET.decode()})
    assert prepare(step(auth), None, signed).params.tenant == "default"  # default's own token passes
    acme = tenant_token(SECRET, "acme", 4_000_000_000)
    assert prepare(step(auth), "acme", acme).params.tenant == "acme"
    assert auth.check("default", None, None) == ""  # the engine's warmup (tier None) is its own
    allowing = TenantAuth.from_env({SECRET_ENV: SECRET.decode()})
    assert allowing.anonymous and prepare(step(allowing), None).params.tenant == "default"


@pytest.mark.parametrize(
    "environ",
    [
        {PREVIOUS_SECRET_ENV: "old"},
        {SECRET_ENV: "s", REQUIRE_EXPIRY_ENV: "maybe"},
        {REQUIRE_EXPIRY_ENV: "1"},
        {ANONYMOUS_ENV: "false"},  # refusing anonymous traffic with nothing to sign tokens
        {SECRET_ENV: "s", ANONYMOUS_ENV: "sometimes"},
        {SECRET_ENV: "s", TRUST_ENV: "true"},  # tokens required and tenants taken as named
        {TRUST_ENV: "sometimes"},
    ],
)
def test_settings_that_make_no_sense_refuse_to_start(environ):
    with pytest.raises(ValueError):
        TenantAuth.from_env(environ)


def test_tokens_are_per_tenant_and_per_secret():
    token = tenant_token(SECRET, "acme")
    assert len(token) == 64 and token == tenant_token(SECRET.decode(), "acme")
    assert token not in (tenant_token(SECRET, "acme2"), tenant_token(b"other", "acme"))


def test_without_a_secret_a_server_serves_default_only_unless_told_to_trust_its_clients():
    """The key salt is set by the server, never by the client (the issue): with nothing to check a
    tenant's claim against, a server took every named tenant as given, and any client could read and fill
    another tenant's caches by naming it (found by a spec review)."""
    tier = TierTable.defaults().default
    auth = TenantAuth.from_env({})
    assert not auth.enabled and auth.check("default", None, tier) == ""
    with pytest.raises(RequestError) as info:
        auth.check("acme", None, tier)
    assert info.value.code == "INVALID_ARG" and SECRET_ENV in info.value.message
    assert TRUST_ENV in info.value.message
    assert auth.check("acme", None) == ""  # the steps' own requests (no tier) are never refused
    critical = TierTable.defaults().get("critical")
    with pytest.raises(RequestError, match="restricted"):  # no token could show the right to jump the queue
        auth.check("default", None, critical)
    trusting = TenantAuth.from_env({TRUST_ENV: "true"})
    assert trusting.check("acme", None, tier) == "" and trusting.check("acme", "junk", tier) == ""
    assert trusting.check("default", None, critical) == ""


@pytest.mark.parametrize(
    "token", [None, "", "00" * 32, tenant_token(SECRET, "other"), tenant_token(b"x", "acme")]
)
def test_with_a_secret_a_named_tenant_needs_its_own_token(token):
    auth = TenantAuth.from_env({SECRET_ENV: SECRET.decode()})
    with pytest.raises(RequestError) as info:
        auth.check("acme", token)
    assert info.value.code == "INVALID_ARG" and "acme" in info.value.message
    assert tenant_token(SECRET, "acme") not in info.value.message  # never echoed


def test_with_a_secret_the_right_token_passes_and_default_needs_none():
    auth = TenantAuth(SECRET)
    token = tenant_token(SECRET, "acme")
    assert auth.check("acme", token) == token and auth.check("acme", token.encode()) == token
    assert auth.check("default", None) == ""


def test_a_client_that_only_names_another_tenant_does_not_read_its_answers(redis_server):
    """Found in review: the tenant was whatever the client wrote; a client naming tenant B read B's
    cached answers through the public ensemble."""
    cache = ExactResponseCache(redis_server, FP)
    victim = f"victim-{uuid.uuid4().hex[:6]}"
    s = step(TenantAuth(SECRET))
    mine = prepare(s, victim, tenant_token(SECRET, victim))
    assert mine.params.tenant_token == tenant_token(SECRET, victim)  # forwarded: the engine checks it too
    assert cache.put(
        mine.input_ids, mine.params, answer("B's confidential answer"), key=mine.params.response_key
    )
    for forged in (None, b"", tenant_token(SECRET, "intruder"), tenant_token(b"guess", victim)):
        with pytest.raises(RequestError):
            prepare(s, victim, forged)
    anonymous = prepare(s, None)
    assert anonymous.params.tenant == "default" and anonymous.params.tenant_token == ""
    assert cache.get(anonymous.input_ids, anonymous.params, anonymous.params.response_key) is None
    unauthenticated = prepare(step(TenantAuth()), victim)  # the same key without the check: the token is
    assert unauthenticated.params.response_key == mine.params.response_key  # in no cache key
    cache.close()


def test_the_engine_refuses_a_direct_request_for_a_tenant_without_its_token(model):  # noqa: F811
    engine = make_engine(model)
    engine.tenant_auth = TenantAuth(SECRET)
    for token in ("", tenant_token(SECRET, "someone-else")):
        with pytest.raises(RequestError) as info:
            engine.submit(request([1, 5, 6], RecordingSink(), tenant="acme", tenant_token=token))
        assert info.value.code == "INVALID_ARG"
    sink = RecordingSink()
    engine.submit(request([1, 5, 6], sink, tenant="acme", tenant_token=tenant_token(SECRET, "acme")))
    engine.submit(request([1, 5, 7], RecordingSink(), "d"))  # default: no token
    run_until_idle(engine)
    assert sink.finished and not sink.errors and engine.stats.finished["length"] == 2


def test_operator_tools_send_the_token_of_the_tenant_they_name(monkeypatch):
    monkeypatch.setenv(SECRET_ENV, SECRET.decode())
    arrays = input_arrays("hi", tenant="acme")
    (sent,) = arrays["tenant_token"].tolist()
    assert TenantAuth(SECRET).check("acme", sent) == sent.decode()
    assert abs(int(sent.split(b".")[0]) - time.time() - 24 * 3600) < 60  # a day, signed
    for default in (input_arrays("hi"), input_arrays("hi", tenant="default")):  # for the restricted tiers
        (sent,) = default["tenant_token"].tolist()
        critical = TierTable.defaults().get("critical")
        assert TenantAuth(SECRET).check("default", sent, critical) == sent.decode()
    assert "tenant_token" not in input_arrays("hi", tenant="acme", tenant_token="")  # "": none, as asked
    assert token_from_env("acme", {}) is None


def test_the_tenant_token_command(monkeypatch, tmp_path):
    out, err = io.StringIO(), io.StringIO()
    monkeypatch.delenv(SECRET_ENV, raising=False)
    # a running make-run stack with a secret of its own: never the one an operator's token is signed with
    me = psutil.Process()
    stack = write_stack(tmp_path / "stack.json", me.pid, me.create_time())
    (tmp_path / "tenant_secret").write_text("a dev stack's\n")
    stack.write_text(
        json.dumps({**json.loads(stack.read_text()), "tenant_secret_file": str(tmp_path / "tenant_secret")})
    )
    monkeypatch.setattr(stack_defaults, "STACK_FILE", stack)
    assert client_main(["tenant-token", "acme"], out, err) == 2 and SECRET_ENV in err.getvalue()
    monkeypatch.setenv(SECRET_ENV, SECRET.decode())
    assert client_main(["tenant-token", "acme"], out, err) == 0
    token = out.getvalue().strip()
    expiry = int(token.split(".")[0])
    assert token == tenant_token(SECRET, "acme", expiry) and "good until" in err.getvalue()
    assert abs(expiry - (time.time() + 30 * 86400)) < 60  # 30 days by default
    assert TenantAuth(SECRET).check("acme", token) == token
    out = io.StringIO()
    assert client_main(["tenant-token", "acme", "--ttl", "never"], out, err) == 0
    assert out.getvalue().strip() == tenant_token(SECRET, "acme")
    out = io.StringIO()
    assert client_main(["tenant-token", "acme", "--ttl", "90m"], out, err) == 0
    assert abs(int(out.getvalue().split(".")[0]) - (time.time() + 5400)) < 60
    for bad in ("0d", "12", "1w", "-5m", "soon", "\u00b2d", "3651d", "20000000d", "99999999999999999999s"):
        with pytest.raises(SystemExit):
            client_main(["tenant-token", "acme", "--ttl", bad], io.StringIO(), io.StringIO())
    assert client_main(["tenant-token", "a b"], io.StringIO(), err) == 2
    out, err = io.StringIO(), io.StringIO()
    assert client_main(["tenant-token", "default"], out, err) == 0 and "restricted tiers" in err.getvalue()
    assert f"every request on servers with {ANONYMOUS_ENV}=false" in err.getvalue()
    assert TenantAuth(SECRET).check("default", out.getvalue().strip()) == out.getvalue().strip()


def test_an_exported_perf_analyzer_input_is_good_for_its_ttl(monkeypatch, tmp_path):
    """Found in review: the export's tokens were the tools' 24 h ones, and a file is replayed later."""
    from client.load import main as load_main

    monkeypatch.setenv(SECRET_ENV, SECRET.decode())

    def exported(*ttl: str) -> str:
        path = tmp_path / "in.json"
        args = ["--count", "4", "--tenants", "2", "--export-perf-analyzer", str(path), "--export-only", *ttl]
        assert load_main(args, io.StringIO(), io.StringIO()) == 0
        entries = json.loads(path.read_text())["data"]
        return next(e["tenant_token"]["content"][0] for e in entries if "tenant_token" in e)

    token = exported()
    later = TenantAuth(SECRET, clock=Clock(time.time() + 29 * 86400))
    tenant = next(
        t
        for t in (f"tenant-{i}" for i in range(2))
        if tenant_token(SECRET, t, int(token.split(".")[0])) == token
    )
    assert later.check(tenant, token) == token
    assert "." not in exported("--export-token-ttl", "never")
    with pytest.raises(SystemExit):
        load_main(["--export-token-ttl", "soon"], io.StringIO(), io.StringIO())


def test_the_compose_and_k8s_servers_get_the_rotation_settings():
    """Found in review: only LLM_TENANT_SECRET reached the container, so the README's rotation refused
    every live token."""
    root = Path(__file__).resolve().parents[1] / "docker"
    env = yaml.safe_load((root / "compose.yaml").read_text())["services"]["triton"]["environment"]
    assert {SECRET_ENV, PREVIOUS_SECRET_ENV, REQUIRE_EXPIRY_ENV, ANONYMOUS_ENV} <= set(env)
    (deployment,) = [
        d
        for d in yaml.safe_load_all((root / "k8s" / "server.yaml").read_text())
        if d and d["kind"] in ("Deployment", "StatefulSet")
    ]
    names = {
        e["name"] for c in deployment["spec"]["template"]["spec"]["containers"] for e in c.get("env", [])
    }
    assert {SECRET_ENV, PREVIOUS_SECRET_ENV, REQUIRE_EXPIRY_ENV, ANONYMOUS_ENV} <= names


def test_generate_takes_a_tenant_token_on_the_command_line():
    from client.__main__ import build_parser

    args = build_parser().parse_args(["generate", "hi", "--tenant", "acme", "--tenant-token", "abc"])
    assert (args.tenant, args.tenant_token) == ("acme", "abc")
    assert build_parser().parse_args(["generate", "hi"]).tenant_token is None  # None: made from the secret


def test_tritons_warmup_samples_are_counted_from_the_model_config():
    """They run before the model is READY, so the first ones the engine's adapter sees are those: its own."""
    from engine.config import triton_warmup_requests

    config = Path(__file__).resolve().parents[1] / "model_repository" / "llm_engine" / "config.pbtxt"
    assert "count: 2" in config.read_text()  # what the shipped config's first_request sample sends
    assert (
        triton_warmup_requests({"model_warmup": [{"name": "first_request", "batch_size": 1, "count": 2}]})
        == 2
    )
    # found in review: Triton skips a sample of batch_size 0 (or none) and sends batch_size per iteration
    skipped = {"name": "b", "batch_size": 0, "count": 3}
    assert (
        triton_warmup_requests({"model_warmup": [{"name": "a", "batch_size": 1, "count": 1}, skipped]}) == 1
    )
    assert triton_warmup_requests({"model_warmup": [{"name": "a", "batch_size": 2, "count": 0}]}) == 2
    assert triton_warmup_requests({"model_warmup": [{"name": "a", "count": 5}]}) == 0
    assert triton_warmup_requests({}) == 0


def test_the_engines_own_requests_skip_only_the_tier_rule_never_a_tenants_token(model):  # noqa: F811
    """Found in review: `own` skipped the whole check, so a miscounted warmup let a request act as any
    tenant."""
    engine = make_engine(model)
    engine.tenant_auth = TenantAuth(SECRET)
    with pytest.raises(RequestError) as info:
        engine.submit(request([1, 5, 6], RecordingSink(), "v", tier="critical", tenant="victim"), own=True)
    assert "victim" in info.value.message


def test_a_tiers_file_without_restricted_keys_keeps_warmup_and_the_top_tier_closed():
    """Found in review: a tiers file written before the key existed opened both to anonymous traffic."""
    table = TierTable.from_mapping(
        {
            "default_tier": "standard",
            "tiers": {
                "critical": {"priority": 1, "ttft_target_ms": 100},
                "warmup": {"priority": 2, "ttft_target_ms": 200},
                "standard": {"priority": 3, "ttft_target_ms": 500},
                "gold": {"priority": 1, "ttft_target_ms": 50, "restricted": False},  # the file's word wins
            },
        }
    )
    assert {t.name: t.restricted for t in table} == {
        "critical": True, "gold": False, "warmup": True, "standard": False,
    }  # fmt: skip
    assert table.for_device("cpu").get("warmup").restricted  # scaling keeps it
    lone = TierTable.from_mapping(
        {"default_tier": "only", "tiers": {"only": {"priority": 1, "ttft_target_ms": 9}}}
    )
    assert lone.get("only").restricted is False  # the default tier is never closed by the rule


def test_a_restricted_default_tier_is_refused_at_load():
    """Found in review: the scheduler's own warmup names no tier and sends no token: it was refused and
    the model failed to load."""
    with pytest.raises(ValueError, match="default tier 'standard' is restricted"):
        TierTable.from_mapping(
            {
                "default_tier": "standard",
                "tiers": {"standard": {"priority": 3, "ttft_target_ms": 500, "restricted": True}},
            }
        )


def test_a_claim_of_another_tenants_name_is_refused_before_the_prompt_is_tokenized():
    """The tokenizer's prefix cache is kept by tenant: a claim that fails must not reach it, or its
    timing would tell the claimant what that tenant sent."""
    tokenized: list[str] = []
    s = SchedulerStep(
        encode=lambda text, tenant: tokenized.append(tenant) or [1, 2],
        limits=Limits(max_prompt_tokens=1000, max_new_tokens=64),
        tiers=TierTable.defaults(),
        tenant_auth=TenantAuth(SECRET),
    )
    with pytest.raises(RequestError, match="needs its tenant_token"):
        prepare(s, "acme")
    with pytest.raises(RequestError, match="is not the token of tenant 'acme'"):
        prepare(s, "acme", tenant_token(SECRET, "globex"))
    assert tokenized == []
    prepare(s, "acme", tenant_token(SECRET, "acme"))
    assert tokenized == ["acme"], "tokenized under the verified tenant"
