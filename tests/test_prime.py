"""Priming the serving path (client/prime.py): requests through the ensemble before clients come."""

from __future__ import annotations

import io

from client.__main__ import main
from client.metrics import metric_total, scrape_metrics
from client.prime import PrimeConfig, prime, prime_once


def finished(metrics_url: str, tier: str) -> float:
    return metric_total(scrape_metrics(metrics_url), "llm_engine_requests_finished_total", tier=tier)


def test_prime_sends_warmup_tier_requests_through_the_ensemble(grpc_url, metrics_url):
    warmup_before, standard_before = finished(metrics_url, "warmup"), finished(metrics_url, "standard")
    result = prime(PrimeConfig(url=grpc_url, lengths=(4, 40), rounds=2))
    assert result.ok and result.requests == 4 and result.errors == []
    assert finished(metrics_url, "warmup") - warmup_before == 4
    assert finished(metrics_url, "standard") == standard_before


def test_a_prompt_over_the_deployments_limit_is_halved_until_it_fits(grpc_url):
    """A small max_seq_len must not leave a replica unprimed (and its health check failing) for good."""
    result = prime(PrimeConfig(url=grpc_url, lengths=(5000,), rounds=1))  # the tiny stack allows 2047 tokens
    assert result.ok and result.shortened >= 1 and result.requests == result.shortened + 1


def test_prime_once_primes_then_only_checks_the_marker(grpc_url, tmp_path):
    marker = tmp_path / "primed"
    first = prime_once(PrimeConfig(url=grpc_url, lengths=(4,), rounds=1), marker)
    assert first is not None and first.ok and marker.exists()
    assert prime_once(PrimeConfig(url=grpc_url, lengths=(4,), rounds=1), marker) is None
    out = io.StringIO()
    assert main(["prime", "--url", grpc_url, "--marker", str(marker)], out=out) == 0
    assert "primed before" in out.getvalue()


def test_prime_cli_primes_a_ready_server(grpc_url):
    out = io.StringIO()
    assert main(["prime", "--url", grpc_url], out=out) == 0
    assert "llm primed: 6 requests" in out.getvalue()


def test_prime_cli_fails_clearly_when_the_server_is_down_or_the_model_unknown(grpc_url, tmp_path):
    err = io.StringIO()
    assert main(["prime", "--url", "localhost:1", "--marker", str(tmp_path / "m")], err=err) == 1
    assert "not reachable" in err.getvalue() and not (tmp_path / "m").exists()
    err = io.StringIO()
    assert main(["prime", "--url", grpc_url, "--model", "no_such_model"], err=err) == 1
    assert "no_such_model" in err.getvalue()


def test_prime_cli_is_not_ready_while_the_replica_drains(grpc_url, tmp_path):
    """The readiness probe of docker/k8s/server.yaml: a replica that drains must leave its Service."""
    marker, draining = tmp_path / "primed", tmp_path / "draining"
    args = ["prime", "--url", grpc_url, "--marker", str(marker), "--drain-file", str(draining)]
    assert main(args, out=io.StringIO()) == 0 and marker.exists()
    draining.touch()
    err = io.StringIO()
    assert main(args, out=io.StringIO(), err=err) == 1
    assert "draining" in err.getvalue()
    draining.unlink()
    assert main(args, out=io.StringIO()) == 0


def test_a_failed_prime_is_reported_not_raised(grpc_url):
    result = prime(PrimeConfig(url=grpc_url, model="no_such_model", lengths=(4,), rounds=1, timeout_s=5))
    assert not result.ok and result.failed == 1 and result.errors


def test_the_launcher_primes_unless_told_not_to(tmp_path, capsys):
    from deploy.launch import StackOptions, start_stack
    from tests.conftest import MODEL_DIR

    with start_stack(StackOptions(run_dir=tmp_path, model_dir=MODEL_DIR, warmup=True, prime=False)) as stack:
        assert "primed" not in capsys.readouterr().out
        before = finished(stack.metrics_url, "warmup")  # Triton's model_warmup samples only
        assert before < 6, "a primed start would show at least its 6 requests"
        assert prime(PrimeConfig(url=stack.grpc_url)).ok
        assert finished(stack.metrics_url, "warmup") == before + 6
