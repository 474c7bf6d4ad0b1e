"""Deployment files (docker/) checked against the launcher the image runs: the image's CMD is parsed by
deploy.launch's own parser (main() with start_stack replaced, so nothing starts). Found in review
(2026-12-07): the launcher gave up at 300 s inside a 600 s startupProbe window, and a literal --redis-url
in the CMD kept a Secret from supplying a password."""

from __future__ import annotations

import os
import re

import yaml

import deploy.launch as launch

DOCKER = launch.REPO_ROOT / "docker"


def image_cmd() -> list[str]:
    cmd = re.search(r"^CMD (\[.*?\])$", (DOCKER / "Dockerfile").read_text(), re.M | re.S).group(1)
    return yaml.safe_load(cmd.replace("\\\n", " "))


def image_env() -> dict[str, str]:
    env = {}
    for line in re.findall(r"^ENV (.+)$", (DOCKER / "Dockerfile").read_text(), re.M):
        for item in line.split():
            key, _, value = item.partition("=")
            env[key] = value
    return env


def launcher_options(argv: list[str], monkeypatch) -> launch.StackOptions:
    """The StackOptions deploy.launch.main builds from the image's CMD (its real argparse)."""
    assert argv[:3] == ["python3", "-m", "deploy.launch"], argv
    seen = []

    def fake_start(opts):
        seen.append(opts)
        raise launch.StackError("not started (test)")

    monkeypatch.setattr(launch, "start_stack", fake_start)
    assert launch.main(argv[3:]) == 1
    (opts,) = seen
    return opts


def server_container() -> dict:
    docs = {d["kind"]: d for d in yaml.safe_load_all((DOCKER / "k8s" / "server.yaml").read_text()) if d}
    return docs["Deployment"]["spec"]["template"]["spec"]["containers"][0]


def test_the_launcher_waits_as_long_as_the_startup_probe_allows(monkeypatch) -> None:
    """server.yaml's startupProbe gives a cold replica 10 minutes (periodSeconds x failureThreshold) to
    become READY and primed; the launcher the image runs gives up on readiness after its --timeout
    (default 300 s) and exits, so the container restarts and the probe's longer window is never
    reached: a replica whose warmup takes 5-10 minutes crash-loops instead of starting."""
    opts = launcher_options(image_cmd(), monkeypatch)
    probe = server_container()["startupProbe"]
    window = probe["periodSeconds"] * probe["failureThreshold"]
    assert opts.ready_timeout_s >= window - probe["periodSeconds"], (opts.ready_timeout_s, window)
    # compose: the health check's start period covers the same wait
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    start_period = int(compose["services"]["triton"]["healthcheck"]["start_period"].rstrip("s"))
    assert start_period >= opts.ready_timeout_s


def test_the_redis_url_can_come_from_a_secret(monkeypatch) -> None:
    """The README puts Redis credentials in the URL (redis://:password@host:6379/0). The image's CMD
    passes --redis-url redis://redis:6379/0 as a literal, which wins over REDIS_URL in the environment
    (launch: `opts.redis_url or os.environ.get("REDIS_URL")`), so a Deployment cannot give a password
    from a Secret without rewriting the command. The Deployment must set REDIS_URL from a Secret and the
    launcher the image runs must then use it."""
    container = server_container()
    env = {e["name"]: e for e in container["env"]}
    assert "REDIS_URL" in env, "server.yaml does not set REDIS_URL"
    ref = env["REDIS_URL"].get("valueFrom", {}).get("secretKeyRef")
    assert ref and ref.get("name"), "REDIS_URL must come from a Secret, not a literal"
    monkeypatch.setenv("REDIS_URL", "redis://:s3cret@redis:6379/0")
    opts = launcher_options(image_cmd(), monkeypatch)
    effective = opts.redis_url or os.environ.get("REDIS_URL", "")
    assert effective == "redis://:s3cret@redis:6379/0", effective
    # without the Secret (optional), the image's default still reaches the compose/k8s `redis` service
    monkeypatch.delenv("REDIS_URL")
    opts = launcher_options(image_cmd(), monkeypatch)
    default = opts.redis_url or image_env().get("REDIS_URL", "")
    assert default == "redis://redis:6379/0"
