"""Fuzz (added in review): SchedulerStep.prepare raises RequestError(INVALID_ARG) or returns, never
anything else, in bounded time."""

import random
import time

import pytest
from tokenizers import Tokenizer

from cache.fingerprint import model_max_len
from scheduler.errors import RequestError
from scheduler.step import SchedulerStep
from scheduler.tenant_auth import TenantAuth, tenant_token
from scheduler.tiers import TierTable
from scheduler.tokenize import PrefixTokenizer, max_prompt_chars, treat_special_tokens
from scheduler.validation import Limits

from tests.conftest import MODEL_DIR
from tests.fuzz_inputs import ODD_STRINGS, rand_sampling_json, rand_value

MODEL = MODEL_DIR
SECRET = b"s3cret"


@pytest.fixture(scope="module")
def tok():
    t = Tokenizer.from_file(f"{MODEL}/tokenizer.json")
    treat_special_tokens(t, "text")
    return t


def make_step(tok, auth):
    max_prompt = model_max_len(MODEL, 2048) - 1
    enc = PrefixTokenizer(tok)
    return SchedulerStep(
        encode=enc,
        limits=Limits(
            max_prompt_tokens=max_prompt,
            max_new_tokens=512,
            max_prompt_chars=max_prompt_chars(tok, max_prompt),
        ),
        tiers=TierTable.defaults().for_device("cpu"),
        exact_fingerprint="fp",
        tenant_auth=auth,
        vocab_size=tok.get_vocab_size(),
    )


def rand_prompt(rng):
    """As Triton delivers text_input: bytes (a BYTES tensor), so never a lone surrogate once decoded."""
    p = _rand_prompt(rng)
    if isinstance(p, str):
        return (
            p.encode("utf-8", "surrogatepass")
            if rng.random() < 0.5
            else p.encode("utf-8", "replace").decode()
        )
    return p


def _rand_prompt(rng):
    r = rng.random()
    if r < 0.3:
        return rng.choice(
            [
                "hello",
                "What is 2+2?",
                "",
                " ",
                "\n\t ",
                "\x00",
                "\x00hello",
                "\u200b",
                "\ufeff",
                "hi\ud800",
                "<s>",
                "</s>",
                "<unk>",
                "[INST]",
                "a" * 100_000,
                "é" * 120_000,
                "🚀" * 50_000,
                "\r\n" * 60_000 + "x",
                b"\xff",
                b"hi",
                b"",
                b"\xed\xa0\x80",
                None,
                5,
                1.5,
                True,
            ]
        )
    if r < 0.6:
        return "".join(chr(rng.randint(0, 0x10FFFF)) for _ in range(rng.randint(0, 200)))
    if r < 0.8:
        return "".join(chr(rng.randint(0, 0x2FF)) for _ in range(rng.randint(0, 3000)))
    return bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 100)))


def rand_name(rng):
    r = rng.random()
    if r < 0.5:
        return rng.choice(ODD_STRINGS + [None, b"", b"t", b"\xff", b"default", 5, True, 1.5, ["t"]])
    if r < 0.7:
        return rand_value(rng)
    return "".join(chr(rng.randint(0, 0x10FFFF)) for _ in range(rng.randint(0, 70)))


def rand_token(rng, tenant):
    r = rng.random()
    if r < 0.3 and isinstance(tenant, str):
        try:
            return tenant_token(SECRET, tenant, rng.choice([None, 10**11, 1]))
        except Exception:
            return None
    if r < 0.6:
        return rng.choice(
            [
                None,
                "",
                "x",
                "1.abc",
                "99999999999999.ab",
                "²." + "a" * 64,
                "\ud800",
                b"\xff",
                b"tok",
                "0." + "0" * 64,
                "." * 10,
                "1" * 100_000 + ".a",
                5,
                True,
                1.5,
                [],
            ]
        )
    return "".join(chr(rng.randint(0, 0x10FFFF)) for _ in range(rng.randint(0, 80)))


def run_cases(step, rng, n, budget_s=5.0):
    """`budget_s` catches catastrophic cases (backtracking, quadratic work) only: not a speed target."""
    outcomes = {"ok": 0, "invalid": 0}
    for i in range(n):
        text = rand_prompt(rng) if rng.random() < 0.5 else "hello there"
        sampling = rand_sampling_json(rng)
        tenant = rand_name(rng) if rng.random() < 0.5 else None
        args = dict(
            text=text,
            sampling_json=sampling,
            stream=rng.choice([None, True, False, 0, 1]),
            exclude_input_in_output=rng.choice([None, True, False]),
            tier=rand_name(rng)
            if rng.random() < 0.4
            else rng.choice([None, "", "batch", "critical", b"batch"]),
            tenant=tenant,
            now_ns=rng.choice([0, 1, time.time_ns(), 2**63 - 1]),
            cache=rand_name(rng) if rng.random() < 0.3 else rng.choice([None, "use", "bypass", b"kv-only"]),
            tenant_token=rand_token(rng, tenant),
            own=rng.random() < 0.2,
        )
        began = time.perf_counter()
        try:
            prepared = step.prepare(**args)
        except RequestError as exc:
            assert exc.code == "INVALID_ARG", (exc, args)
            exc.message.encode("utf-8")  # goes back to the client as UTF-8
            outcomes["invalid"] += 1
        except Exception as exc:  # noqa: BLE001
            pytest.fail(f"case {i}: {type(exc).__name__}: {exc!s:.300} for {str(args)[:600]}")
        else:
            outcomes["ok"] += 1
            prepared.params.to_bytes()  # the step's output must serialize
        took = time.perf_counter() - began
        assert took < budget_s, (took, str(args)[:400])
    return outcomes


@pytest.mark.parametrize("auth", ["open", "secret", "no-trust"])
def test_prepare_never_raises_anything_but_invalid_arg(tok, auth):
    auths = {
        "open": TenantAuth(),
        "secret": TenantAuth(secret=SECRET, require_expiry=False),
        "no-trust": TenantAuth(trust_client=False),
    }
    step = make_step(tok, auths[auth])
    out = run_cases(step, random.Random(f"step-{auth}"), 600)
    print(auth, out)
    assert out["ok"] > 0 and out["invalid"] > 0


def test_sampling_parameters_alone(tok):
    """Everything else valid: only sampling_parameters varies, so the checks past JSON parsing run."""
    step = make_step(tok, TenantAuth())
    rng = random.Random("sampling")
    counts = {"ok": 0, "invalid": 0}
    for i in range(3000):
        sampling = rand_sampling_json(rng)
        try:
            prepared = step.prepare(b"hello there", sampling, True, False, None, None, now_ns=1)
        except RequestError as exc:
            assert exc.code == "INVALID_ARG"
            exc.message.encode("utf-8")
            counts["invalid"] += 1
        except Exception as exc:  # noqa: BLE001
            pytest.fail(f"case {i}: {type(exc).__name__}: {exc!s:.300} for {str(sampling)[:400]!r}")
        else:
            counts["ok"] += 1
            prepared.params.to_bytes()
    print(counts)
    assert counts["ok"] > 100


def test_valid_sampling_values_near_the_bounds(tok):
    """Values at and around every bound: accepted exactly when in range, and what is accepted serializes
    and survives the engine's parse and check (EngineRequestParams.from_bytes, engine/requests.py)."""
    import json
    from engine.requests import check_params
    from scheduler.messages import EngineRequestParams
    from tests.fuzz_inputs import ODD_NUMBERS

    step = make_step(tok, TenantAuth())
    rng = random.Random("bounds")
    accepted = 0
    for i in range(3000):
        obj = {
            k: rng.choice(ODD_NUMBERS + [None])
            for k in rng.sample(
                ["max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos"], rng.randint(1, 6)
            )
        }
        try:
            text = json.dumps(obj)
        except ValueError:
            continue
        try:
            prepared = step.prepare(b"hello there", text, False, False, None, None, now_ns=1)
        except RequestError as exc:
            assert exc.code == "INVALID_ARG"
            continue
        accepted += 1
        back = EngineRequestParams.from_bytes(prepared.params.to_bytes())
        assert back == prepared.params
        check_params(back, step.limits.max_new_tokens)
    print("accepted", accepted)
    assert accepted > 50
