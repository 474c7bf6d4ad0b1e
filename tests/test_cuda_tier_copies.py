"""L1 <-> L2 <-> slot copies with copies kept in flight: a review found these paths safe by reading
(one stream for every tier copy, `settle()` before host reads of L2, blocking copies for L3); these tests
guard that on a CUDA machine.

`torch.cuda._sleep` kernels queued ahead keep every copy below in flight when the host goes on:
- a store's copy out of a slot, the slot overwritten right after (the next request's prefill);
- L1 rows handed to a store or a promotion while the demotion to L2 and the load out of them are queued;
- L2 slots reused by a demotion while an earlier demotion into them or a promotion out of them is queued;
  host reads of L2 (`get` -> `take_run` -> `settle`).
Every block's bytes are random and distinct per prompt, and every path is a pure copy, so the checks are
bitwise (`torch.equal`). The second test runs the whole Engine (deferred stores, decode steps writing
idle slots) and compares every prefill's logits and slot KV with an uncached prefill; the third checks
that the L3 writer thread gets the bytes as of publish time. CUDA_TEST_DEVICE=cpu runs the tests' own
logic on the CPU (no race there).
"""

from __future__ import annotations

import os
import random

import pytest
import torch

DEVICE = os.environ.get("CUDA_TEST_DEVICE", "cuda")  # "cpu": a dry run of the tests' own logic, no race
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SLEEP_CYCLES = 2_000_000  # ~1 ms on an H200 at ~2 GHz


def _model(dtype=torch.float32, max_len=512):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=500, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=256, max_position_embeddings=max_len,
    )  # fmt: skip
    return LlamaForCausalLM(config).to(DEVICE).to(dtype).eval()


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _slow(rng: random.Random) -> None:
    if rng.random() < 0.8 and DEVICE == "cuda":
        torch.cuda._sleep(rng.choice((SLEEP_CYCLES // 4, SLEEP_CYCLES, 4 * SLEEP_CYCLES)))


@pytest.mark.parametrize("l2_order", ["runs", "scattered"])
def test_blocks_stay_bitwise_through_l1_l2_churn_with_copies_in_flight(l2_order):
    from engine.l2_pool import HostBlockPool
    from engine.model_runner import ModelRunner
    from engine.prefix_cache import PrefixCache

    runner = ModelRunner(_model(), slots=4, max_len=512, kv_buckets=(64, 128))
    cache = PrefixCache(runner, capacity_blocks=10, block_size=16, fingerprint="review-stress")
    cache.l2 = HostBlockPool(24, tuple(cache.pool.shape[1:]), cache.pool.dtype, pin=True)
    assert cache.l2.page_locked or DEVICE != "cuda"
    rng = random.Random(7 if l2_order == "runs" else 8)
    if l2_order == "scattered":
        rng.shuffle(cache.l2.free)
    prompts = [[1] + [rng.randrange(5, 500) for _ in range(16 * n)] for n in rng.choices(range(1, 8), k=14)]
    block_shape = tuple(cache.pool.shape[1:])
    truth = [torch.randn((len(p) // 16, *block_shape), device=DEVICE) for p in prompts]
    truth_host = [t.cpu() for t in truth]
    where = {}  # key -> (prompt, block)
    for i, p in enumerate(prompts):
        for b, key in enumerate(cache.chain_keys(p, "t")):
            where[key] = (i, b)
    _sync()

    pending: list[tuple[int, int, torch.Tensor]] = []  # (prompt, blocks, device snapshot) checked later
    loads = l2_reads = 0
    for step in range(600):
        i = rng.randrange(len(prompts))
        prompt = prompts[i]
        slot = rng.randrange(runner.slots)
        _slow(rng)
        hits = cache.lookup(prompt, "t")
        if hits:
            cache.load(slot, hits)
            loads += 1
            pending.append((i, len(hits), runner.read_blocks(slot, len(hits), 16).clone()))
        # "compute" the rest: the slot holds what was loaded, then the true blocks after it
        full = torch.cat([runner.read_blocks(slot, len(hits), 16), truth[i][len(hits) :]])
        runner.write_blocks(slot, full)
        _slow(rng)
        cache.store(slot, prompt, "t")
        runner.write_blocks(slot, torch.randn_like(full))  # the slot reused at once by the next request
        if cache.l2.index and rng.random() < 0.25:  # a host read of L2 (settle)
            key = rng.choice(list(cache.l2.index))
            held = cache.l2.get(key)
            a, b = where[key]
            l2_reads += 1
            assert torch.equal(held, truth_host[a][b]), f"step {step}: L2 block {b} of prompt {a} on the host"
        if step % 25 == 24:
            _sync()
            for a, n, got in pending:
                assert torch.equal(got, truth[a][:n]), f"before step {step}: {n} loaded blocks of prompt {a}"
            pending.clear()
    _sync()
    for a, n, got in pending:
        assert torch.equal(got, truth[a][:n])
    print(
        f"loads {loads}, L2 hit blocks {cache.l2.hits}, L2 evictions {cache.l2.evictions}, "
        f"host reads {l2_reads}"
    )
    assert loads > 100 and cache.l2.hits > 50 and cache.l2.evictions > 20 and l2_reads > 50, (
        loads, cache.l2.hits, cache.l2.evictions, l2_reads,
    )  # fmt: skip


class _Sink:
    def __init__(self):
        self.tokens: list[int] = []
        self.errors: list[tuple[str, str]] = []
        self.final = False

    def send(self, token_ids, read_offset, final, trim_bytes=0):
        self.tokens += list(token_ids)[read_offset:]
        self.final = self.final or final

    def fail(self, code, message):
        self.errors.append((code, message))

    def cancelled(self):
        return False


@pytest.mark.parametrize("mode", ["fp32-eager", "bf16-graphs"])
def test_engine_prefills_through_tiers_match_uncached_prefills(mode):
    """Every prefill the engine runs (L1 hits, L2 promotions, misses; stores deferred to the next step's
    launch) against the same prompt prefilled without any cache; the copies are slowed as above."""
    from engine.engine import Engine
    from engine.l2_pool import HostBlockPool
    from engine.model_runner import ModelRunner
    from engine.prefix_cache import PrefixCache
    from engine.requests import EngineRequest
    from scheduler.messages import EngineRequestParams

    graphs = mode == "bf16-graphs"
    if graphs and DEVICE != "cuda":
        pytest.skip("CUDA graphs")
    dtype = torch.bfloat16 if graphs else torch.float32
    model = _model(dtype)
    buckets = (16, 32, 64, 128, 256)
    runner = ModelRunner(model, slots=4, max_len=512, kv_buckets=(64, 128, 256))
    reference = ModelRunner(model, slots=1, max_len=512, kv_buckets=(64, 128, 256))
    if graphs:
        runner.use_cuda_graphs = runner.use_prefill_graphs = True
        for bucket in buckets + (512,):
            runner.prefill_graphs.capture(bucket)
        for kv in runner.kv_buckets:
            runner.capture_decode_graph(kv)
    engine = Engine(runner, lambda t: bytes([97 + t % 26]), {2}, buckets)
    cache = engine.prefix_cache = PrefixCache(runner, 12, 16, "review-engine")
    cache.l2 = HostBlockPool(40, tuple(cache.pool.shape[1:]), cache.pool.dtype, pin=True)
    rng = random.Random(3)

    prefills: list[tuple[list[int], int, torch.Tensor, torch.Tensor]] = []
    real_prefill = runner.prefill

    def prefill(slot, token_ids, padded_len, start=0):
        logits = real_prefill(slot, token_ids, padded_len, start)
        kv, local = runner.slot_cache(slot)  # the slot's keys/values right after it: loaded + computed
        prefills.append(
            (list(token_ids), start, logits.clone(), kv[:, :, local, :, : len(token_ids)].clone())
        )
        return logits

    runner.prefill = prefill
    for name in ("store", "lookup"):
        real = getattr(cache, name)

        def slowed(*args, _real=real, **kwargs):
            _slow(rng)
            return _real(*args, **kwargs)

        setattr(cache, name, slowed)

    heads = [
        [1] + [rng.randrange(5, 500) for _ in range(rng.choice((31, 47, 79, 127, 159)))] for _ in range(7)
    ]
    sinks = []
    for wave in range(40):
        for n in range(rng.randint(1, 6)):
            prompt = rng.choice(heads) + [rng.randrange(5, 500) for _ in range(rng.randint(1, 40))]
            sink = _Sink()
            params = EngineRequestParams(max_tokens=rng.randint(1, 4), ignore_eos=True, stream=True,
                                         tenant=rng.choice(("a", "b")))  # fmt: skip
            engine.submit(EngineRequest(f"r{wave}-{n}", prompt, params, 3, 0, sink))
            sinks.append(sink)
        for _ in range(500):
            if not engine.step():
                break
    assert all(s.final and not s.errors for s in sinks)
    hits = [start for _, start, _, _ in prefills if start]
    print(
        f"{len(prefills)} prefills, {len(hits)} after a reused prefix; L1 hit blocks {cache.hit_blocks}, "
        f"L2 hit blocks {cache.l2.hits}, L1 evictions {cache.evictions}, L2 evictions {cache.l2.evictions}"
    )
    assert len(hits) > 30 and cache.l2.hits > 20, (len(hits), cache.l2.hits)
    # relative to the largest magnitude; a block of another prompt (or a stale row) is off by ~1
    kv_tolerance, logits_tolerance = (6e-2, 1e-1) if graphs else (1e-3, 1e-3)
    ref_kv, _ = reference.slot_cache(0)
    for tokens, start, logits, kv in prefills:
        expected = reference.prefill(0, tokens, engine.prefill_bucket(len(tokens)))
        expected_kv = ref_kv[:, :, 0, :, : len(tokens)]
        kv_error = float((kv.float() - expected_kv.float()).abs().max() / expected_kv.float().abs().max())
        error = float((logits - expected).abs().max() / expected.abs().max())
        what = f"prefill of {len(tokens)} tokens, {start} reused"
        assert kv_error < kv_tolerance, f"{what}: the slot's KV is off by {kv_error:.3g} (relative)"
        assert error < logits_tolerance, f"{what}: logits off by {error:.3g} (relative)"


class _SlowStore:
    """Stands in for RedisKVStore behind L3Tier: the writer thread takes its time, then keeps what it got."""

    def __init__(self):
        self.written: dict[bytes, torch.Tensor] = {}

    def write_chain(self, keys, tensors, meta, tenant=None, head=()):
        import time

        from cache.redis_kv_store import ChainWrite

        time.sleep(0.002)  # the engine thread goes on: rows reused, slots overwritten
        for key, tensor in zip(keys, tensors):
            self.written[key] = tensor.clone()
        return ChainWrite(len(keys), [])

    def exists_chain(self, keys):
        return 0

    def known_each(self, keys):
        return [False] * len(keys)

    def close(self):
        pass


def test_blocks_handed_to_the_l3_writer_are_the_bytes_at_publish_time():
    """L3 writes read host copies made on the engine thread (kv_tiers.py:167, a blocking copy): the
    writer thread must see each block as it was when published (from a slot at its store,
    prefix_cache.py:280, or from L1 rows after a reuse, prefix_cache.py:295), although the slot and the
    rows are overwritten right after, with the device kept busy."""
    from cache.kv_format import KVBlockMeta, dtype_name
    from engine.kv_tiers import LAYOUT, L3Tier
    from engine.l2_pool import HostBlockPool
    from engine.model_runner import ModelRunner
    from engine.prefix_cache import PrefixCache

    runner = ModelRunner(_model(), slots=4, max_len=512, kv_buckets=(64, 128))
    cache = PrefixCache(runner, capacity_blocks=10, block_size=16, fingerprint="review-l3")
    cache.l2 = HostBlockPool(16, tuple(cache.pool.shape[1:]), cache.pool.dtype, pin=True)
    shape = runner.shape
    meta = KVBlockMeta(
        model_fingerprint="review-l3", dtype=dtype_name(runner.dtype),
        shape=(shape.layers, 2, shape.kv_heads, 16, shape.head_dim), token_count=16, layout=LAYOUT,
    )  # fmt: skip
    store = _SlowStore()
    cache.l3 = L3Tier(store, meta, backlog=100_000)
    cache.publish_on_first_use = False  # a block goes to L3 on its reuse (the default policy)
    rng = random.Random(11)
    prompts = [[1] + [rng.randrange(5, 500) for _ in range(16 * n)] for n in rng.choices(range(1, 6), k=10)]
    truth = [torch.randn((len(p) // 16, *tuple(cache.pool.shape[1:])), device=DEVICE) for p in prompts]
    where = {key: (i, b) for i, p in enumerate(prompts) for b, key in enumerate(cache.chain_keys(p, "t"))}
    _sync()
    for step in range(300):
        i = rng.randrange(len(prompts))
        slot = rng.randrange(runner.slots)
        _slow(rng)
        hits = cache.lookup(prompts[i], "t")
        if hits:
            cache.load(slot, hits)
        full = torch.cat([runner.read_blocks(slot, len(hits), 16), truth[i][len(hits) :]])
        runner.write_blocks(slot, full)
        _slow(rng)
        cache.store(slot, prompts[i], "t", publish=rng.random() < 0.3)
        runner.write_blocks(slot, torch.randn_like(full))
        if rng.random() < 0.1:  # L3 forgets some keys, so that they are written again later
            cache.l3._forget(rng.sample(list(where), 3))
    cache.l3._writes.close(timeout_s=60)
    print(f"{len(store.written)} blocks written to L3, {cache.l3.writes_dropped} dropped")
    assert cache.l3.writes_dropped == 0 and cache.l3.writes_failed == 0
    assert len(store.written) > 10
    for key, block in store.written.items():
        a, b = where[key]
        assert torch.equal(block, truth[a][b].cpu()), f"block {b} of prompt {a} reached L3 changed"
