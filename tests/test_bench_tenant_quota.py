"""bench.tenant_quota, small: against a real bounded redis-server, the quota keeps the quiet tenant's hot
blocks and holds the flood to its quota, while without it Redis's own evictions take them."""

from __future__ import annotations

import json

from bench.tenant_quota import main


def test_the_quota_keeps_the_quiet_tenants_blocks_and_the_flood_at_its_quota(tmp_path):
    args = ["--rounds", "2", "--flood-per-round", "75", "--maxmemory", "16mb", "--quota", "64"]
    assert main([*args, "--out-dir", str(tmp_path), "--tag", "t"]) == 0
    data = json.loads((tmp_path / "tenant-quota-t.json").read_text())
    free, quota = data["results"]
    assert (free["quota"], quota["quota"]) == (0, 64)
    assert free["redis_evicted"] > 0 and free["acme_held"] < 64, "a 37 MiB flood through 16 MiB evicts acme"
    assert quota["acme_served"] == [1.0, 1.0] and quota["acme_held"] == 64
    assert quota["flood_held"] == 64 and quota["quota_evictions"] == 1200 - 64 and quota["redis_evicted"] == 0
    assert (tmp_path / "tenant-quota-t.png").stat().st_size > 0


def test_the_exact_quota_keeps_the_quiet_tenants_answers_and_the_flood_at_its_quota(tmp_path):
    args = ["--cache", "exact", "--rounds", "2", "--flood-per-round", "2500", "--maxmemory", "4mb"]
    assert (
        main([*args, "--quota", "100", "--acme-entries", "20", "--out-dir", str(tmp_path), "--tag", "t"]) == 0
    )
    data = json.loads((tmp_path / "tenant-quota-exact-t.json").read_text())
    free, quota = data["results"]
    assert free["redis_evicted"] > 0 and free["acme_held"] < 20, "a 10 MiB flood through 4 MiB evicts acme"
    assert quota["acme_served"] == [1.0, 1.0] and quota["acme_held"] == 20
    assert (
        quota["flood_held"] == 100 and quota["quota_evictions"] == 5000 - 100 and quota["redis_evicted"] == 0
    )
    assert (tmp_path / "tenant-quota-exact-t.png").stat().st_size > 0
