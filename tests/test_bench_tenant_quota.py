"""bench.tenant_quota, small: against a real bounded redis-server, the quota keeps the quiet tenant's hot
blocks and holds the flood to its quota, while without it Redis's own evictions take them."""

from __future__ import annotations

import json

from bench.tenant_quota import main


def test_the_quota_keeps_the_quiet_tenants_blocks_and_the_flood_at_its_quota(tmp_path):
    args = ["--rounds", "2", "--flood-blocks-per-round", "600", "--maxmemory", "16mb", "--quota", "64"]
    assert main([*args, "--out-dir", str(tmp_path), "--tag", "t"]) == 0
    data = json.loads((tmp_path / "tenant-quota-t.json").read_text())
    free, quota = data["results"]
    assert (free["quota_blocks"], quota["quota_blocks"]) == (0, 64)
    assert free["redis_evicted"] > 0 and free["acme_held"] < 64, "a 37 MiB flood through 16 MiB evicts acme"
    assert quota["acme_served"] == [1.0, 1.0] and quota["acme_held"] == 64
    assert quota["flood_held"] == 64 and quota["quota_evictions"] == 1200 - 64 and quota["redis_evicted"] == 0
    assert (tmp_path / "tenant-quota-t.png").stat().st_size > 0
