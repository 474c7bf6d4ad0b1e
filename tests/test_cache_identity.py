"""Found in review: what the response caches' keys must name besides the serving fingerprint.

1. The device type of a seeded (sampled) answer. A CPU torch.Generator and a CUDA one seeded alike draw
   other streams (engine/sampling.py), so in a fleet of CPU and CUDA replicas sharing one Redis, a seeded
   answer computed on one device type must not be served by a replica of the other: it is not what that
   replica computes for the same seed. Greedy answers (argmax draws nothing) stay shared, under the keys
   they had.
2. The semantic cache's embedder. Vectors of another embedder (another model, other weights, another
   truncation or pooling) must never be compared with this one's: its entries live under other keys.

All against a real redis-server (tests/conftest.py's `redis_server`) and the real all-MiniLM-L6-v2.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import uuid

import numpy as np
import pytest

from cache.response_cache import ExactResponseCache, canonical_json, exact_key, sha256_hex, tenant_tag
from cache.semantic_cache import SemanticResponseCache
from scheduler.messages import EngineRequestParams
from tests.conftest import answer

GREEDY = EngineRequestParams(max_tokens=8, temperature=0.0, tenant="t")
SEEDED = EngineRequestParams(max_tokens=8, temperature=0.8, top_p=0.9, top_k=40, seed=7, tenant="t")
PROMPT = [1, 306, 4966, 263, 1139]
QUESTION = "How do I reset my password?"


def fp() -> str:
    return f"fp-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def minilm():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from cache.embedder import MiniLMEmbedder

    return MiniLMEmbedder()


class Named:
    """The real embedder's vectors under a name of its own: another embedder, as the cache sees it."""

    def __init__(self, inner, identity: str):
        self.inner, self.identity, self.dim = inner, identity, inner.dim

    def embed(self, texts):
        return self.inner.embed(texts)

    def fits(self, texts):
        return self.inner.fits(texts)


# -- 1. device type of seeded answers ------------------------------------------------------------------


def test_a_seeded_exact_answer_of_one_device_type_is_not_served_to_another(redis_server):
    shared = fp()
    cpu = ExactResponseCache(redis_server, shared, timeout_s=0.5, device="cpu")
    gpu = ExactResponseCache(redis_server, shared, timeout_s=0.5, device="cuda")
    gpu1 = ExactResponseCache(redis_server, shared, timeout_s=0.5, device="cuda:1")
    try:
        drawn_on_cpu = answer(" drawn by the cpu generator")
        assert cpu.put(PROMPT, SEEDED, drawn_on_cpu)
        assert cpu.get(PROMPT, SEEDED) == drawn_on_cpu
        assert gpu.get(PROMPT, SEEDED) is None, "a CUDA replica served a CPU generator's seeded answer"
        drawn_on_gpu = answer(" drawn by the cuda generator")
        assert gpu.put(PROMPT, SEEDED, drawn_on_gpu)
        assert gpu1.get(PROMPT, SEEDED) == drawn_on_gpu  # cuda:N draws as cuda: one device type
        assert cpu.get(PROMPT, SEEDED) == drawn_on_cpu  # neither overwrote the other
    finally:
        for c in (cpu, gpu, gpu1):
            c.close()


def test_a_greedy_exact_answer_stays_shared_by_every_device_type_under_the_key_it_had(redis_server):
    shared = fp()
    cpu = ExactResponseCache(redis_server, shared, timeout_s=0.5, device="cpu")
    gpu = ExactResponseCache(redis_server, shared, timeout_s=0.5, device="cuda")
    try:
        assert cpu.put(PROMPT, GREEDY, answer(" argmax"))
        assert gpu.get(PROMPT, GREEDY) == answer(" argmax")
        # the key of before: no entry written by the code before the fix is orphaned
        sampling = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None, "stop": []}
        doc = {"fp": shared, "tenant": "t", "sampling": {**sampling, "ignore_eos": False}}
        digest = sha256_hex(canonical_json(doc), struct.pack(f"<{len(PROMPT)}q", *PROMPT))
        before = f"llm:resp:exact:v3:{shared}:{tenant_tag('t')}:{digest}"
        assert gpu.key(PROMPT, GREEDY) == cpu.key(PROMPT, GREEDY) == before
    finally:
        cpu.close()
        gpu.close()


def test_the_scheduler_step_hashes_the_key_of_its_engines_device():
    from scheduler.step import SchedulerStep
    from scheduler.tiers import TierTable
    from scheduler.validation import Limits

    def prepared(device: str, sampling: dict):
        step = SchedulerStep(
            encode=lambda text, tenant: [ord(c) for c in text],
            limits=Limits(max_prompt_tokens=100, max_new_tokens=64),
            tiers=TierTable.defaults(),
            exact_fingerprint="fp-1",
            device=device,
        )
        return step.prepare("hello", json.dumps(sampling), True, None, None, "t", now_ns=1)

    seeded = {"temperature": 0.8, "seed": 3}
    on_gpu, on_cpu = prepared("cuda", seeded), prepared("cpu", seeded)
    assert on_gpu.params.response_key != on_cpu.params.response_key
    engine = ExactResponseCache.__new__(ExactResponseCache)  # its key function only, no Redis
    engine.fingerprint = "fp-1"
    engine.rng = "cuda"
    assert engine.key(on_gpu.input_ids, on_gpu.params) == on_gpu.params.response_key
    assert exact_key("fp-1", on_cpu.input_ids, on_cpu.params, rng="cpu") == on_cpu.params.response_key
    greedy = {"temperature": 0}
    assert prepared("cuda:0", greedy).params.response_key == prepared("cpu", greedy).params.response_key


def test_the_loader_keys_both_caches_by_the_engines_device(redis_server):
    from engine.config import EngineConfig
    from engine.detokenize import TokenDecoder
    from engine.loader import build_response_tier
    from tests.conftest import MODEL_DIR

    decoder = TokenDecoder.from_model_dir(MODEL_DIR)
    config = EngineConfig(
        redis_url=redis_server,
        device="cuda:0",
        redis_key_directory=False,
        semantic_cache=True,
        semantic_pair_check=False,
        semantic_verifier=False,
    )
    tier = build_response_tier(config, fp(), MODEL_DIR, decoder, print)
    try:
        assert tier.semantic is not None
        assert tier.cache.key(PROMPT, SEEDED) == exact_key(tier.cache.fingerprint, PROMPT, SEEDED, rng="cuda")
        assert tier.cache.key(PROMPT, SEEDED) != exact_key(tier.cache.fingerprint, PROMPT, SEEDED, rng="cpu")
        cpu_semantic = SemanticResponseCache(redis_server, "x", tier.semantic.embedder, verifier=None)
        try:
            assert tier.semantic.signature(SEEDED) != cpu_semantic.signature(SEEDED)
            assert tier.semantic.signature(GREEDY) == cpu_semantic.signature(GREEDY)
        finally:
            cpu_semantic.close()
    finally:
        tier.close()


def test_a_seeded_semantic_answer_of_one_device_type_is_not_served_to_another(redis_server, minilm):
    shared = fp()
    cpu = SemanticResponseCache(redis_server, shared, minilm, verifier=None, device="cpu")
    gpu = SemanticResponseCache(redis_server, shared, minilm, verifier=None, device="cuda")
    try:
        assert cpu.store(QUESTION, "t", SEEDED, answer(" cpu draw"))
        assert cpu.lookup(QUESTION, "t", SEEDED).answer == answer(" cpu draw")
        assert gpu.lookup(QUESTION, "t", SEEDED) is None, "a CUDA replica served a CPU generator's answer"
        assert cpu.store(QUESTION, "t", GREEDY, answer(" argmax"))
        hit = gpu.lookup(QUESTION, "t", GREEDY)  # greedy: shared across device types
        assert hit is not None and hit.answer == answer(" argmax")
    finally:
        cpu.close()
        gpu.close()


# -- 2. the semantic cache's embedder --------------------------------------------------------------------


def test_semantic_caches_of_other_embedders_never_see_each_others_entries(redis_server, minilm):
    shared = fp()
    a = SemanticResponseCache(redis_server, shared, Named(minilm, "embedder-a"), verifier=None)
    b = SemanticResponseCache(redis_server, shared, Named(minilm, "embedder-b"), verifier=None)
    a2 = SemanticResponseCache(redis_server, shared, Named(minilm, "embedder-a"), verifier=None)
    try:
        assert a.store(QUESTION, "t", GREEDY, answer(" a's answer"))
        assert b.lookup(QUESTION, "t", GREEDY) is None, "vectors of another embedder were compared"
        assert not set(a._keys("t")) & set(b._keys("t"))
        assert b.snapshot()["corrupt"] == 0  # not read (and deleted as bad): simply other keys
        hit = a2.lookup(QUESTION, "t", GREEDY)  # another replica with the same embedder: shared
        assert hit is not None and hit.answer == answer(" a's answer")
        assert b.store(QUESTION, "t", GREEDY, answer(" b's answer"))
        assert a.lookup(QUESTION, "t", GREEDY).answer == answer(" a's answer")  # b wrote over nothing
    finally:
        for c in (a, b, a2):
            c.close()


def test_an_embedder_swapped_for_another_identity_reads_its_own_entries_only(redis_server, minilm):
    from cache.embed_coalescer import CoalescingEmbedder

    shared = fp()
    cache = SemanticResponseCache(redis_server, shared, minilm, verifier=None)
    try:
        assert cache.store(QUESTION, "t", GREEDY, answer(" minilm's"))
        cache.embedder = CoalescingEmbedder(minilm)  # the benchmark's swap: the same vectors, same keys
        assert cache.lookup(QUESTION, "t", GREEDY).answer == answer(" minilm's")
        cache.embedder = Named(minilm, "retrained")  # held in memory too: that copy must go
        assert cache.lookup(QUESTION, "t", GREEDY) is None
        cache.embedder = minilm
        assert cache.lookup(QUESTION, "t", GREEDY).answer == answer(" minilm's")
    finally:
        cache.close()


def test_minilms_identity_names_its_checkpoint_and_recipe(minilm, tmp_path, monkeypatch):
    import cache.embedder as embedder_module
    from cache.embed_coalescer import CoalescingEmbedder
    from cache.embedder import default_model_dir, embedder_identity

    shipped = default_model_dir()
    identity = embedder_identity(shipped, 256)
    assert minilm.identity == identity and len(identity) == 16 and int(identity, 16) >= 0
    assert CoalescingEmbedder(minilm).identity == identity
    assert embedder_identity(shipped, 128) != identity  # another truncation, other vectors
    # the same checkpoint elsewhere (another replica's install): the same identity, not the path's
    copy = tmp_path / "minilm"
    shutil.copytree(shipped, copy)
    assert embedder_identity(copy, 256) == identity
    # retrained weights under the same config: one tensor changed
    weights = copy / "model.safetensors"
    with weights.open("r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        name = sorted(k for k in header if k != "__metadata__")[len(header) // 2]
        start, end = header[name]["data_offsets"]
        f.seek(8 + n + start)
        f.write(np.random.default_rng(0).bytes(min(4096, end - start)))
    assert embedder_identity(copy, 256) != identity
    monkeypatch.setattr(embedder_module, "EMBED_RECIPE", "cls-pool-v1")  # another pooling
    assert embedder_identity(shipped, 256) != identity


def test_a_lookup_and_a_store_do_not_hash_the_checkpoint_again(redis_server, minilm, monkeypatch):
    import cache.embedder as embedder_module

    cache = SemanticResponseCache(redis_server, fp(), minilm, verifier=None)
    try:
        monkeypatch.setattr(embedder_module, "embedder_identity", lambda *a: pytest.fail("hashed per call"))
        monkeypatch.setattr("cache.fingerprint.checkpoint_digest", lambda *a: pytest.fail("hashed per call"))
        assert cache.store(QUESTION, "t", GREEDY, answer(" once"))
        assert cache.lookup(QUESTION, "t", GREEDY).answer == answer(" once")
    finally:
        cache.close()


def test_the_semantic_key_names_the_embedder_deterministically_and_forget_tenant_finds_it(
    redis_server, minilm
):
    """Two processes with the same embedder compute the same keys (no Python hash(), which is salted per
    process), and the tenant tag stays last in the hash tag, where `forget-tenant`'s pattern finds it."""
    import hashlib

    from cache.tenant_erasure import erase_tenant

    shared = fp()
    c = SemanticResponseCache(redis_server, shared, minilm, verifier=None)
    try:
        tag = hashlib.sha256(minilm.identity.encode()).hexdigest()[:16]
        assert c._keys("gone")[0] == f"llm:resp:sem:v3:{{{shared}:{tag}:{tenant_tag('gone')}}}:emb"
        assert c.store(QUESTION, "gone", GREEDY, answer(" to be erased"))
        assert c.client.exists(*c._keys("gone")) == 4
        assert erase_tenant(c.client, "gone").keys["semantic"] >= 4
        assert c.client.exists(*c._keys("gone")) == 0
    finally:
        c.close()
