"""What the cost model is told a load moved must be what it timed. A chain Redis holds with a gap (a block
evicted that the key directory, or the probe made on arrival, still lists) is one MGET that brings back
every value after the gap too; crediting the load with the leading run's bytes alone makes one such
lookup read as a Redis many times slower than it is, and the replica recomputes its L3 prefixes."""

from __future__ import annotations

from cache.cost_model import LoadCostModel
from cache.redis_kv_store import RedisKVStore
from engine.kv_tiers import L3Tier
from tests.test_redis_kv_store import META, _block, _keys


class Recording(LoadCostModel):
    def __init__(self) -> None:
        super().__init__(prior_prefill_tokens_per_s=1.0)  # loads always win
        self.loads: list[tuple[int, float]] = []

    def observe_load(self, nbytes: int, seconds: float) -> None:
        self.loads.append((nbytes, seconds))
        super().observe_load(nbytes, seconds)


def test_a_load_is_credited_with_every_block_its_round_trip_moved(redis_server, request):
    store = RedisKVStore(redis_server, f"kv-test:{request.node.name}", timeout_s=0.5)
    cost = Recording()
    l3 = L3Tier(store, META, cost)
    try:
        keys = _keys(16)
        assert store.put_chain(keys, [_block(i) for i in range(16)], META) == 16
        store.client.delete(store.redis_key(keys[1]))  # evicted after the probe saw it
        blocks, outcome = l3.fetch_with_outcome(keys, [True] * 16)
        assert (len(blocks), outcome) == (1, "partial")
        moved = 15 * l3.block_bytes  # the MGET brought back every value but the evicted one
        assert all(nbytes >= moved for nbytes, _ in cost.loads), (cost.loads, moved)
    finally:
        l3.close()
