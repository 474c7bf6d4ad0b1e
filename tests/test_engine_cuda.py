"""CUDA-only engine checks (run on the GPU machine; skipped where there is no CUDA device)."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine.model_runner import ModelRunner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture
def model():
    """A small random Llama on the GPU, the same for every test (seeded)."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=500, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=256, max_position_embeddings=256,
    )  # fmt: skip
    return LlamaForCausalLM(config).cuda().eval()


@pytest.mark.parametrize("pools", [None, [(16, 2), (256, 2)]], ids=["one-pool", "length-classes"])
def test_decode_graph_replays_match_eager_decode(model, pools):
    runner = ModelRunner(model, slots=4, max_len=256, kv_buckets=(16, 64), pools=pools)
    for slot, prompt in enumerate(([1, 5, 9], [1, 7, 7, 7, 7, 7])):
        runner.prefill(slot, prompt, 16)
    tokens = torch.tensor([11, 12, 0, 0], device="cuda")
    positions = torch.tensor([3, 6, 0, 0], device="cuda")
    eager = runner.decode(tokens, positions, 64).clone()
    runner.capture_decode_graph(64)
    assert runner.graph_buckets == (64,)
    for slot, prompt in enumerate(([1, 5, 9], [1, 7, 7, 7, 7, 7])):
        runner.prefill(slot, prompt, 16)
    replayed = runner.decode(tokens, positions, 64)
    torch.testing.assert_close(replayed, eager, atol=1e-4, rtol=1e-4)


def test_warmup_stages_carry_cuda_event_times_beside_host_times(model):
    from engine.engine import Engine
    from engine.warmup import run_warmup

    runner = ModelRunner(model, slots=2, max_len=256, kv_buckets=(16, 64))
    engine = Engine(runner, lambda t: bytes([97 + t % 26]), {2}, (16, 64))
    report = run_warmup(engine, enabled=True)
    for stage in report.stages:
        assert stage.device_seconds is not None and 0 <= stage.device_seconds <= stage.seconds * 1.05


@pytest.mark.parametrize("pools", [None, [(64, 2), (256, 2)]], ids=["one-pool", "length-classes"])
def test_prefill_graph_replay_matches_eager_prefill(model, pools):
    eager = ModelRunner(model, slots=4, max_len=256, kv_buckets=(16, 64), pools=pools)
    graphed = ModelRunner(model, slots=4, max_len=256, kv_buckets=(16, 64), pools=pools)
    graphed.prefill_graphs.capture(64)
    assert graphed.prefill_graphs.buckets == (64,)
    assert graphed.prefill_graphs.suffix_buckets == ()  # fp32: flash attention has no fp32 kernel
    for slot, prompt in ((1, [1, 5, 9, 30, 31]), (3, list(range(1, 50))), (0, [1, 2, 3])):
        expected = eager.prefill(slot, prompt, 64)
        torch.randn(4096, device="cuda")  # freed memory gets reused: a graph must own its inputs
        replays = graphed.prefill_graphs.replays
        replayed = graphed.prefill(slot, prompt, 64)
        assert graphed.prefill_graphs.replays == replays + 1
        torch.testing.assert_close(replayed, expected, atol=1e-4, rtol=1e-4)
        blocks = len(prompt) // 16
        torch.testing.assert_close(graphed.read_blocks(slot, blocks, 16), eager.read_blocks(slot, blocks, 16))


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "suffix-graph"])
def test_prefill_after_a_reused_prefix_matches_a_whole_prefill(model, graphs):
    """Lower-right causal alignment after a reused prefix (eager: flash with causal_lower_right;
    graph: flash varlen over the staging buffer, bf16 as served) against one whole prefill."""
    model = model.to(torch.bfloat16)
    runner = ModelRunner(model, slots=2, max_len=256, kv_buckets=(16, 64))
    if graphs:
        for bucket in (32, 64):
            runner.prefill_graphs.capture(bucket)
        assert runner.prefill_graphs.suffix_buckets == (32, 64)
    prompt = list(range(1, 90))
    whole = runner.prefill(0, prompt, 128)
    for start, padded in ((64, 32), (48, 64)):
        runner.write_blocks(1, runner.read_blocks(0, start // 16, 16))
        suffix = runner.prefill(1, prompt, padded, start=start)
        torch.testing.assert_close(suffix, whole, atol=3e-2, rtol=3e-2)
        assert int(suffix.argmax()) == int(whole.argmax())
        torch.testing.assert_close(
            runner.read_blocks(1, 5, 16), runner.read_blocks(0, 5, 16), atol=3e-2, rtol=3e-2
        )
    assert runner.prefill_graphs.replays == (2 if graphs else 0)


def test_device_prewarm_runs_on_its_own_stream_beside_other_work(model, tmp_path):
    """The prewarm thread runs while the main thread keeps using the device (as the weight load does)."""
    from engine.device_prewarm import DevicePrewarm, PrewarmShape

    model.save_pretrained(tmp_path)
    shape = PrewarmShape(slots=2, max_len=256, buckets=(16, 64), pools=[(256, 2)], order=(64, 16))
    prewarm = DevicePrewarm(str(tmp_path), torch.float32, "cuda", shape, origin_ns=0).start()
    busy = torch.ones(512, 512, device="cuda")
    for _ in range(50):
        busy = (busy @ busy).clamp_(-1, 1)
    stage = prewarm.finish(stop=False)
    assert prewarm.summary.error is None
    expected = ["sampling", "prefill:64", "prefill:16", "decode:16", "decode:64", "decode:256"]
    assert prewarm.summary.done == expected
    assert stage.items == 6 and bool(torch.isfinite(busy).all())


@pytest.mark.parametrize("slots", ["runs", "scattered"])
def test_blocks_demoted_to_pinned_l2_without_a_sync_come_back_intact(model, slots):
    """The device pool's evictions go to pinned L2 as asynchronous copies that nothing waits for: a
    host read of L2 (settle) and a promotion back to the device (stream order, one copy per run of
    slots) both see the blocks, whether a chain's L2 slots are one run or scattered."""
    from engine.l2_pool import HostBlockPool
    from engine.prefix_cache import PrefixCache

    runner = ModelRunner(model, slots=2, max_len=256, kv_buckets=(16, 64))
    cache = PrefixCache(runner, capacity_blocks=4, block_size=16, fingerprint="cuda-test")
    cache.l2 = HostBlockPool(16, tuple(cache.pool.shape[1:]), cache.pool.dtype, pin=True)
    if slots == "scattered":
        cache.l2.free = [5, 14, 2, 9, 0, 11, 7, 3, 12, 1, 8, 15, 4, 10, 6, 13]
    first, second = list(range(1, 66)), list(range(100, 165))
    runner.prefill(0, first, 128)
    expected = runner.read_blocks(0, 4, 16).clone()
    assert cache.store(0, first, "t") == 4
    runner.prefill(1, second, 128)
    expected_second = runner.read_blocks(1, 4, 16).clone()
    assert cache.store(1, second, "t") == 4  # evicts all of `first` into L2
    keys = cache.chain_keys(first, "t")
    assert all(key in cache.l2 and key not in cache.index for key in keys)
    torch.testing.assert_close(torch.stack([cache.l2.get(key) for key in keys]).cuda(), expected)
    hits = cache.lookup(first, "t")  # promotes `first`, demoting `second` in the same stream
    assert len(hits) == 4
    cache.load(0, hits)
    torch.testing.assert_close(runner.read_blocks(0, 4, 16), expected)
    hits = cache.lookup(second, "t")
    assert len(hits) == 4
    cache.load(0, hits)
    torch.testing.assert_close(runner.read_blocks(0, 4, 16), expected_second)


def test_token_picks_land_on_the_host_without_waiting_for_work_queued_after_them(model):
    from engine.sampling import Sampler, TokenPicker

    logits = torch.randn(4, 500, device="cuda")
    picker = TokenPicker(4, torch.device("cuda"))
    samplers = {0: Sampler(0.0, 1.0, 0, None, logits.device), 2: Sampler(0.8, 1.0, 0, 7, logits.device)}
    picks = picker.launch(logits, samplers)
    assert picks.in_flight
    later = torch.ones(2048, 2048, device="cuda") @ torch.ones(2048, 2048, device="cuda")
    tokens = picks.result()
    assert tokens[0] == int(logits[0].argmax()) and 0 <= tokens[2] < 500
    assert float(later[0, 0]) == 2048.0
    again = Sampler(0.8, 1.0, 0, 7, logits.device).pick(logits[2])
    assert tokens[2] == again, "a seeded slot draws from its own generator"


def test_a_pending_prompt_is_stored_while_the_next_prefill_runs_on_the_device(model):
    """On a GPU the prompts a lookup leaves pending (another first block) are stored between the next
    prefill's launch and its first token, not left for the decode step; the first tokens match."""
    from engine.engine import Engine
    from engine.prefix_cache import PrefixCache
    from tests.test_engine_batching import RecordingSink, request

    runner = ModelRunner(model, slots=2, max_len=256, kv_buckets=(16, 64))
    engine = Engine(runner, lambda t: bytes([97 + t % 26]), {2}, (16, 64))
    engine.prefix_cache = PrefixCache(runner, 16, 16, "cuda-test")
    first, second = [1] + list(range(200, 248)), [1] + list(range(40, 88))
    sinks = RecordingSink(), RecordingSink()
    for rid, prompt, sink in zip("ab", (first, second), sinks):
        engine.submit(request(prompt, sink, rid=rid, max_tokens=4, tenant="t"))
    engine._admit()
    assert list(engine._pending_stores) == [1]
    assert len(engine.prefix_cache.lookup(first + [9], "t")) == 3
    expected = [int(model(torch.tensor([p], device="cuda")).logits[0, -1].argmax()) for p in (first, second)]
    assert [sink.tokens[0] for sink in sinks] == expected


def test_l2_is_pinned_at_its_exact_size_and_blocks_round_trip():
    """torch's pinned allocator would round 6 MiB + 1 block up to 8 MiB; registered pages are exact."""
    from engine.l2_pool import HostBlockPool

    block = (2, 2, 4, 16, 32)  # 16 KiB of float16
    before = _host_allocator_bytes()
    pool = HostBlockPool(385, block, torch.float16, pin=True)  # 6 MiB + 1 block: not a power of two
    assert pool.page_locked and pool.pool.is_pinned()
    assert pool.bytes == 385 * 16384
    assert _host_allocator_bytes() - before < pool.bytes  # none of it from torch's caching host allocator
    source = torch.randn((6, *block), device="cuda").half()
    assert pool.put_many([bytes([i]) for i in range(6)], source) == 6
    slots = pool.take_run([bytes([i]) for i in range(6)])
    torch.testing.assert_close(pool.pool[slots].to("cuda"), source)
    small = [HostBlockPool(3, (1, 100), torch.float16, pin=True) for _ in range(4)]  # 600 B each
    assert all(p.page_locked for p in small)  # a page each: none shares one another one registered


def test_a_pool_dropped_with_copies_in_flight_is_unlocked_after_them():
    """Dropping a pool waits for the copies still queued into it before its pages are unlocked, and the
    next pool locks its own: 256 MiB queued from the device, the pool dropped at once."""
    import gc

    from engine.pinned_memory import page_locked_empty

    source = torch.ones(128 * 2**20, dtype=torch.float16, device="cuda")
    for _ in range(3):
        host, locked = page_locked_empty(tuple(source.shape), torch.float16)
        assert locked
        host.copy_(source, non_blocking=True)
        del host
        gc.collect()
    again, locked = page_locked_empty((1024,), torch.float16)
    assert locked and again.copy_(source[:1024]).sum().item() == 1024


def _host_allocator_bytes() -> int:
    stats = getattr(torch.cuda, "host_memory_stats", None)  # not in every torch build
    return stats().get("allocated_bytes.current", 0) if stats is not None else 0


def test_the_loader_sizes_l1_in_device_memory_and_pins_l2_exactly():
    """The byte-sized tiers on CUDA: L1 in device memory, L2 page-locked at the size asked (96 MiB, not
    torch's 128). Blocks' round trips through registered pages: the demotion test above."""
    from engine.cache_stats import cache_gauges
    from engine.config import EngineConfig
    from engine.loader import load_engine
    from tests.conftest import MODEL_DIR

    if not (MODEL_DIR / "config.json").exists():
        from engine.build_model import build

        build("tiny", MODEL_DIR)
    config = EngineConfig(
        model_dir=str(MODEL_DIR), device="cuda", response_cache=False, l3_kv_cache=False,
        prefill_templates="", warmup=False, prefix_cache_memory="64MiB", l2_cache_memory="96MiB",
    )  # fmt: skip
    before = _host_allocator_bytes()
    engine = load_engine(config, log=lambda message: None).engine
    try:
        cache = engine.prefix_cache
        assert cache.pool.is_cuda and cache.bytes <= 64 * 2**20 < cache.bytes + cache.bytes // cache.capacity
        assert cache.l2.page_locked and cache.l2.pool.is_pinned()
        assert cache.l2.bytes <= 96 * 2**20 and _host_allocator_bytes() - before < cache.l2.bytes
        assert cache_gauges(cache, None)[("l2", "page_locked")] == 1.0
    finally:
        engine.shutdown(1.0)
