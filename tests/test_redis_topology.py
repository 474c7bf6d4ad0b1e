"""Which Redis deployments the caches accept, against real redis-servers: a standalone one and a
cluster with every slot on one master are used (the cache clients work on the latter too); a cluster
of two masters is refused by the engine's loader and by `forget-tenant`, naming the problem; a Redis
that is down, or a cluster failing, is an outage and is not refused."""

from __future__ import annotations

import io
import uuid

import pytest
import redis

from cache.redis_topology import UnsupportedRedis, check_redis_url, parse_cluster_info
from client.__main__ import main
from deploy.launch import find_free_port
from engine.config import EngineConfig
from engine.loader import load_engine
from tests.conftest import MODEL_DIR, wait_for
from tests.test_cache_report import metrics_url  # noqa: F401  (the fixture)
from tests.test_redis_auth import exercise_every_client, spawn_redis

SLOTS = 16384


def cluster_node(run_dir) -> tuple[int, int, object]:
    """A cluster-enabled redis-server with no slots yet: (port, cluster bus port, process)."""
    port, bus = find_free_port(), find_free_port()  # the default bus port, port + 10000, may not exist
    args = ["--port", str(port), "--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf",
            "--cluster-port", str(bus)]  # fmt: skip
    return port, bus, spawn_redis(run_dir, args, f"redis://127.0.0.1:{port}/0")


def cluster_info(port: int) -> dict[str, str]:
    client = redis.Redis(port=port)
    try:
        return parse_cluster_info(client.execute_command("CLUSTER", "INFO"))
    finally:
        client.close()


def assign(port: int, first: int, last: int) -> None:
    client = redis.Redis(port=port)
    try:
        client.execute_command("CLUSTER", "ADDSLOTSRANGE", first, last)
    finally:
        client.close()


@pytest.fixture(scope="module")
def one_master(tmp_path_factory):
    """A cluster whose one master serves every slot (a one-shard managed cluster): its URL."""
    port, _, proc = cluster_node(tmp_path_factory.mktemp("one-master"))
    assign(port, 0, SLOTS - 1)
    assert wait_for(lambda: cluster_info(port)["cluster_state"] == "ok", 10.0)
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture(scope="module")
def two_masters(tmp_path_factory):
    """A cluster of two masters with half the slots each, once both see it whole: the first's port."""
    run_dir = tmp_path_factory.mktemp("two-masters")
    (a, _, proc_a), (b, bus_b, proc_b) = cluster_node(run_dir), cluster_node(run_dir)
    assign(a, 0, SLOTS // 2 - 1)
    assign(b, SLOTS // 2, SLOTS - 1)
    client = redis.Redis(port=a)
    client.execute_command("CLUSTER", "MEET", "127.0.0.1", b, bus_b)
    client.close()
    whole = {"cluster_state": "ok", "cluster_size": "2"}
    assert wait_for(lambda: all(whole.items() <= cluster_info(p).items() for p in (a, b)), 20.0)
    yield a
    for proc in (proc_a, proc_b):
        proc.terminate()
        proc.wait(timeout=10)


def test_a_standalone_redis_is_used(redis_server):
    assert check_redis_url(redis_server).kind == "standalone"


def test_a_redis_that_is_down_is_an_outage_not_a_refusal():
    topology = check_redis_url(f"redis://127.0.0.1:{find_free_port()}/0")
    assert topology.kind == "unknown" and "ConnectionError" in topology.detail


def test_a_cluster_with_every_slot_on_one_master_is_used(one_master):
    topology = check_redis_url(one_master)
    assert (topology.kind, topology.masters, topology.state) == ("cluster", 1, "ok")
    exercise_every_client(one_master)


def test_a_cluster_that_serves_no_slot_is_an_outage_not_a_refusal(tmp_path):
    port, _, proc = cluster_node(tmp_path)
    try:
        topology = check_redis_url(f"redis://127.0.0.1:{port}/0")
        assert topology.kind == "cluster" and topology.state == "fail"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_a_cluster_of_two_masters_is_refused_naming_the_problem(two_masters):
    with pytest.raises(UnsupportedRedis, match="Redis Cluster of 2 masters"):
        check_redis_url(f"redis://127.0.0.1:{two_masters}/0")


def test_a_database_other_than_0_on_a_cluster_is_refused(one_master):
    with pytest.raises(UnsupportedRedis, match="database other than 0"):
        check_redis_url(one_master.rsplit("/", 1)[0] + "/2")


def test_the_engine_does_not_load_against_a_cluster_of_two_masters(two_masters):
    config = EngineConfig(
        model_dir=str(MODEL_DIR), response_cache=False, prefill_templates="", warmup=False,
        redis_url=f"redis://127.0.0.1:{two_masters}/0",
    )  # fmt: skip
    with pytest.raises(UnsupportedRedis, match="MOVED"):
        load_engine(config, log=lambda message: None)


def test_forget_tenant_refuses_a_cluster_of_two_masters(two_masters):
    tenant = f"t-{uuid.uuid4().hex[:6]}"
    url = f"redis://127.0.0.1:{two_masters}/0"
    out, err = io.StringIO(), io.StringIO()
    assert main(["forget-tenant", tenant, "--redis-url", url], out=out, err=err) == 1
    assert "Redis Cluster of 2 masters" in err.getvalue() and "forget-tenant" in err.getvalue()
    assert out.getvalue() == ""


def test_the_cache_report_names_the_topology_and_refuses_two_masters(one_master, two_masters, metrics_url):  # noqa: F811
    out = io.StringIO()
    assert main(["cache", "--metrics-url", metrics_url, "--redis-url", one_master], out=out) == 0
    assert out.getvalue().strip().endswith("; cluster, 1 master serving slots (state ok)")
    out, err = io.StringIO(), io.StringIO()
    url = f"redis://127.0.0.1:{two_masters}/0"
    assert main(["cache", "--metrics-url", metrics_url, "--redis-url", url], out=out, err=err) == 1
    assert "Redis Cluster of 2 masters" in err.getvalue() and out.getvalue() == ""
