"""The deployment files (docker/) checked against the code they configure: no cluster or Docker engine
runs here, so these are what keeps a probe's flags, the drain marker's path and the grace periods
in step with the launcher and the client."""

from __future__ import annotations

import copy
import inspect
import re
from pathlib import Path

import pytest
import yaml

from client.__main__ import build_parser
from deploy.launch import DEFAULT_RUN_DIR, DRAIN_FILE, REPO_ROOT, Stack
from engine.cache_sizing import GIB, HOST_SHARE, parse_memory

DOCKER = REPO_ROOT / "docker"


def documents(path: Path) -> dict[str, dict]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all(path.read_text()) if doc}


def image_path(path: Path) -> Path:
    """Where a repository path lies in the image (the Dockerfile copies the repository to its WORKDIR)."""
    workdir = re.search(r"^WORKDIR (\S+)$", (DOCKER / "Dockerfile").read_text(), re.M).group(1)
    return Path(workdir) / path.relative_to(REPO_ROOT)


def stop_bound_s() -> float:
    """The longest a stop takes by the launcher's defaults: the drain, then tritonserver's stop."""
    defaults = inspect.signature(Stack.stop).parameters
    return defaults["drain_timeout_s"].default + defaults["timeout_s"].default


def client_args(command: list[str]):
    """`python3 -m client ...` parsed by the client's own parser (an unknown flag exits)."""
    assert command[:3] == ["python3", "-m", "client"], command
    return build_parser().parse_args(command[3:])


@pytest.fixture(scope="module")
def server() -> dict[str, dict]:
    return documents(DOCKER / "k8s" / "server.yaml")


def test_the_grace_periods_cover_the_drain_and_the_servers_stop(server) -> None:
    pod = server["Deployment"]["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] > stop_bound_s()
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    assert int(compose["services"]["triton"]["stop_grace_period"].rstrip("s")) > stop_bound_s()


def test_readiness_fails_while_the_launchers_drain_marker_exists(server) -> None:
    container = server["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    args = client_args(container["readinessProbe"]["exec"]["command"])
    assert args.command == "prime" and args.marker is not None
    assert args.drain_file == image_path(DEFAULT_RUN_DIR / DRAIN_FILE)
    assert client_args(container["startupProbe"]["exec"]["command"]).command == "prime"
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    health = compose["services"]["triton"]["healthcheck"]["test"]
    assert health[0] == "CMD" and client_args(health[1:]).drain_file == args.drain_file


def test_the_service_selects_the_replicas_and_serves_the_ports_the_image_opens(server) -> None:
    deployment, service = server["Deployment"], server["Service"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert server["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    exposed = {
        int(port)
        for port in re.findall(r"^EXPOSE (.+)$", (DOCKER / "Dockerfile").read_text(), re.M)[0].split()
    }
    container_ports = {
        port["containerPort"] for port in deployment["spec"]["template"]["spec"]["containers"][0]["ports"]
    }
    assert container_ports == exposed == {port["port"] for port in service["spec"]["ports"]}


def test_the_warmup_cronjob_reaches_the_services_grpc_port(server) -> None:
    cronjob = documents(DOCKER / "k8s" / "warmup-cronjob.yaml")["CronJob"]
    container = cronjob["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]
    args = client_args(container["command"] + container["args"])
    host, port = args.url.split(":")
    grpc = next(p for p in server["Service"]["spec"]["ports"] if p["name"] == "grpc")
    assert (host, int(port)) == (server["Service"]["metadata"]["name"], grpc["port"])
    metrics = next(p for p in server["Service"]["spec"]["ports"] if p["name"] == "metrics")
    assert args.metrics_url == f"http://{host}:{metrics['port']}/metrics"


def test_the_image_runs_the_launcher_in_the_foreground() -> None:
    """SIGTERM must reach a launcher that drains, not a detached one that already returned."""
    cmd = re.search(r"^CMD (\[.*?\])$", (DOCKER / "Dockerfile").read_text(), re.M | re.S).group(1)
    argv = yaml.safe_load(cmd.replace("\\\n", " "))
    assert argv[:3] == ["python3", "-m", "deploy.launch"] and "--foreground" in argv


PROCESS_HOST_GIB = 6  # the server's own host memory with the 1B model: weights loading, Python, Triton


def test_the_pods_l2_fits_the_memory_limit_the_engine_checks_it_against(server) -> None:
    """The engine refuses an L2 beyond HOST_SHARE of what its cgroup leaves: the manifest must not ask
    for one, or every replica fails its load."""
    container = server["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    env = {item["name"]: item["value"] for item in container["env"] if "value" in item}
    l2 = parse_memory("l2_cache_memory", env["LLM_L2_CACHE_MEMORY"])
    assert parse_memory("prefix_cache_memory", env["LLM_PREFIX_CACHE_MEMORY"]) > 0
    limit = parse_memory("memory", container["resources"]["limits"]["memory"])
    assert l2 <= HOST_SHARE * (limit - PROCESS_HOST_GIB * GIB)
    assert container["resources"]["requests"]["memory"] == container["resources"]["limits"]["memory"]


def test_the_compose_redis_is_bounded_and_evicts_as_the_launchers_does() -> None:
    from deploy.launch import REDIS_POLICY

    command = yaml.safe_load((DOCKER / "compose.yaml").read_text())["services"]["redis"]["command"]
    options = dict(zip(command[1::2], command[2::2]))
    assert options["--maxmemory-policy"] == REDIS_POLICY
    assert parse_memory("maxmemory", options["--maxmemory"].replace("gb", "GB")) >= GIB


KUBERNETES_VERSION = "1.30"  # the oldest release still in upstream support when these were written


@pytest.mark.parametrize("manifest", ["server.yaml", "warmup-cronjob.yaml"])
def test_every_resource_is_valid_for_the_kubernetes_api(manifest: str) -> None:
    """Strict: a misspelled or misplaced field (`limit:` for `limits:`, a probe under the pod spec) is an
    error here, not a resource the API server rejects or silently drops at deploy time."""
    import kubernetes_validate

    for doc in yaml.safe_load_all((DOCKER / "k8s" / manifest).read_text()):
        if doc:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_schema_check_catches_a_misspelled_field(server) -> None:
    import kubernetes_validate

    deployment = copy.deepcopy(server["Deployment"])  # the fixture is shared by the module
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["resources"]["limit"] = container["resources"].pop("limits")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


def test_servers_and_the_warmup_job_read_one_tenant_secret(server) -> None:
    """The job's tokens are made from the secret the servers check them against (scheduler/tenant_auth)."""
    from scheduler.tenant_auth import SECRET_ENV

    job = yaml.safe_load_all((DOCKER / "k8s" / "warmup-cronjob.yaml").read_text())
    cron = next(doc for doc in job if doc and doc["kind"] == "CronJob")
    pods = [
        server["Deployment"]["spec"]["template"]["spec"]["containers"][0],
        cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0],
    ]
    refs = [{e["name"]: e.get("valueFrom") for e in pod["env"]}[SECRET_ENV] for pod in pods]
    assert refs[0] == refs[1] and refs[0]["secretKeyRef"]["name"]


def test_every_llm_setting_the_servers_get_is_one_the_repository_reads() -> None:
    """A misspelt variable in compose or the k8s Deployment would be ignored without a word: each LLM_*
    they set must be read by a model's config.pbtxt (`${LLM_...}`) or by the tenant check."""
    from scheduler.tenant_auth import (
        ANONYMOUS_ENV,
        PREVIOUS_SECRET_ENV,
        REQUIRE_EXPIRY_ENV,
        SECRET_ENV,
        TRUST_ENV,
    )

    configs = "".join(p.read_text() for p in (REPO_ROOT / "model_repository").glob("*/config.pbtxt"))
    read = set(re.findall(r"\$\{(LLM_[A-Z0-9_]+)", configs)) | {
        SECRET_ENV,
        PREVIOUS_SECRET_ENV,
        REQUIRE_EXPIRY_ENV,
        ANONYMOUS_ENV,
        TRUST_ENV,
    }
    docker = REPO_ROOT / "docker"
    compose = yaml.safe_load((docker / "compose.yaml").read_text())["services"]["triton"]["environment"]
    (deployment,) = [
        d for d in yaml.safe_load_all((docker / "k8s" / "server.yaml").read_text())
        if d and d["kind"] in ("Deployment", "StatefulSet")
    ]  # fmt: skip
    k8s = {e["name"] for c in deployment["spec"]["template"]["spec"]["containers"] for e in c.get("env", [])}
    for where, names in (("compose", set(compose)), ("k8s", k8s)):
        unread = {name for name in names if name.startswith("LLM_")} - read
        assert not unread, f"{where} sets {sorted(unread)}, which nothing reads"
    assert {"LLM_L3_TENANT_MAX_BLOCKS", "LLM_EXACT_TENANT_MAX_ENTRIES"} <= set(compose) & k8s


def exported_metric_names() -> set[str]:
    """Every llm_* metric family the Triton adapters create (they name them as string literals)."""
    adapters = REPO_ROOT / "adapters"
    return {
        name for path in adapters.glob("*.py") for name in re.findall(r'"(llm_[a-z_]+)"', path.read_text())
    }


def cache_counter_names() -> set[str]:
    """The `counter` label values of llm_engine_cache_total (engine/cache_stats.py and what it reads)."""
    from dataclasses import fields

    from cache.response_cache import ExactCacheStats, ExactResponseCache
    from engine import cache_stats

    literals = re.findall(r'"([a-z_]+)"', inspect.getsource(cache_stats))
    refusals = re.findall(r'"([a-z_]+)"', inspect.getsource(ExactResponseCache.snapshot))
    return {*literals, *refusals, *cache_stats.L3_COUNTERS, *(f.name for f in fields(ExactCacheStats))}


def test_the_alerts_watch_series_the_engine_exports_at_the_tiers_targets():
    """An alert on a misspelt series never fires, and reads as all clear: each metric and `counter` an
    alert names must be one the engine exports, and each TTFT alert the target of scheduler/tiers.yaml."""
    from scheduler.tiers import TierTable

    rule = documents(DOCKER / "k8s" / "alerts.yaml")["PrometheusRule"]
    rules = [r for group in rule["spec"]["groups"] for r in group["rules"]]
    exported, counters, tiers = exported_metric_names(), cache_counter_names(), TierTable.defaults()
    ttft_alerts = 0
    for alert in rules:
        expr = alert["expr"]
        names = re.findall(r"\b(llm_[a-z_]+)", expr)
        assert names and all(name.removesuffix("_bucket") in exported for name in names), alert["alert"]
        for value in re.findall(r'counter=~?"([^"]+)"', expr):
            assert set(value.split("|")) <= counters, (alert["alert"], value)
        quantile = re.search(r'histogram_quantile\(([\d.]+),.*tier="(\w+)".*\)\s*>\s*([\d.]+)', expr, re.S)
        if quantile:
            tier = tiers.get(quantile.group(2))
            assert float(quantile.group(1)) == tier.percentile / 100, alert["alert"]
            assert float(quantile.group(3)) == tier.ttft_target_ms / 1000, alert["alert"]
            ttft_alerts += 1
    assert ttft_alerts == 2 and "tier_errors" in counters and "no_such_counter" not in counters
