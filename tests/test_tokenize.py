"""The scheduler's tokenization: the fast path and the prefix reuse give exactly the ids of `encode`."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from tokenizers import Tokenizer

from scheduler.tokenize import (
    PrefixTokenizer,
    PrefixTokenStats,
    ids_encoder,
    max_prompt_chars,
    safe_splits,
    treat_special_tokens,
)
from tests.conftest import MODEL_DIR

TEXTS = [
    "Hello",
    "  leading and trailing spaces  ",
    "tabs\tand\nnew lines\r\n",
    "émoji 🚀 and CJK 漢字, accents: naïve café",
    "numbers 3.14159 and 1,000,000 and 2026-11-29",
    "don't won't it's I'm",
    "x" * 3000,
    "",
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_fast_path_ids_equal_encode(tokenizer, text):
    assert ids_encoder(tokenizer)(text) == tokenizer.encode(text).ids


def test_a_tokenizer_without_the_fast_path_falls_back_to_encode(tokenizer):
    class Plain:
        def encode(self, text, add_special_tokens=True):
            return tokenizer.encode(text, add_special_tokens=add_special_tokens)

    assert ids_encoder(Plain())("fallback path") == tokenizer.encode("fallback path").ids


WORDS = ["alpha", "beta", "gamma", "naïve", "café", "x1", "42", "3.14", "don't", "—", "🚀", "漢字", "a", "I"]


def document(seed: int, words: int) -> str:
    rng = random.Random(seed)
    parts = []
    for _ in range(words):
        word = rng.choice(WORDS)
        parts.append(word + rng.choice(["", "", "", ",", ".", "!", "\n", "  "]))
    return " ".join(parts)


def test_cuts_start_a_word_after_a_non_space_and_depend_only_on_the_prefix():
    shared = document(1, 800)
    a, b = shared + " first ending", shared + " another, longer ending"
    cuts_a, cuts_b = safe_splits(a, 512), safe_splits(b, 512)
    assert cuts_a and all(a[c] == " " and not a[c - 1].isspace() and a[c + 1].isalpha() for c in cuts_a)
    inside = [c for c in cuts_a if c < len(shared) - 64]
    assert inside and inside == [c for c in cuts_b if c < len(shared) - 64]


def test_prompts_sharing_a_long_prefix_reuse_its_ids_and_match_a_whole_encode(tokenizer):
    prefixed = PrefixTokenizer(tokenizer, verify_first=0, verify_every=10**9)  # no checks: compare here
    shared = document(2, 900)
    for seed in range(40):
        text = shared + " " + document(100 + seed, 30 + seed)
        assert prefixed(text) == tokenizer.encode(text).ids, seed
    # the first prompt only notes its cuts, the second remembers them, the rest reuse them
    assert prefixed.stats.hits == 38 and prefixed.stats.misses == 2 and prefixed.enabled
    assert prefixed("short prompt") == tokenizer.encode("short prompt").ids  # below min_chars


def test_a_tokenizer_that_does_not_compose_is_caught_and_the_cache_turns_off(tokenizer):
    class AppendsEos:  # a template that appends a token: prefix + rest misses it
        def encode(self, text, add_special_tokens=True):
            encoding = tokenizer.encode(text, add_special_tokens=add_special_tokens)
            if not add_special_tokens:
                return encoding
            return SimpleNamespace(ids=encoding.ids + [1], offsets=encoding.offsets + [(0, 0)])

    eos = AppendsEos()
    prefixed = PrefixTokenizer(eos)
    shared = document(3, 900)
    results = [prefixed(shared + f" ending number {i}") for i in range(3)]
    assert results == [eos.encode(shared + f" ending number {i}").ids for i in range(3)]
    assert not prefixed.enabled and prefixed.stats.mismatches == 1 and not prefixed._prefixes


def test_a_prefix_one_tenant_sent_is_not_reused_for_another(tokenizer):
    prefixed = PrefixTokenizer(tokenizer, verify_first=0, verify_every=10**9)
    shared = document(4, 900)
    for i in range(3):  # noted, remembered, reused
        assert (
            prefixed(shared + f" acme asks {i}", "acme") == tokenizer.encode(shared + f" acme asks {i}").ids
        )
    assert prefixed.stats.hits == 1
    for i in range(3):  # the same document under another tenant starts from nothing
        text = shared + f" globex asks {i}"
        assert prefixed(text, "globex") == tokenizer.encode(text).ids
    assert prefixed.stats.hits == 2 and prefixed.stats.misses == 4, "globex noted, remembered, then reused"
    assert prefixed._noted.owners().keys() == {"acme", "globex"}


def test_the_prefix_table_is_bounded(tokenizer):
    prefixed = PrefixTokenizer(tokenizer, capacity=8)
    for seed in range(6):
        prefixed(document(10 + seed, 900))
    assert not prefixed._prefixes  # one-off prompts: only their cuts are noted
    for seed in range(6):
        prefixed(document(10 + seed, 900) + " again")
    assert len(prefixed._prefixes) == 8 and len(prefixed._noted) <= 8 * 8


def test_warming_leaves_no_entry_and_no_counts(tokenizer):
    prefixed = PrefixTokenizer(tokenizer)
    prefixed.warm()
    assert not prefixed._prefixes and prefixed.stats == PrefixTokenStats() and prefixed.enabled
    assert prefixed._composed >= prefixed.verify_first  # the first checks ran on synthetic text


def test_prompt_text_that_spells_a_special_token_stays_text_unless_parse_is_asked():
    """ "</s>" typed in a prompt was the EOS token: a client could end the model's input mid-prompt, and the
    echoed prompt lost the tag. The `<s>` the template adds stays."""
    tokenizer = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    bos, eos = tokenizer.token_to_id("<s>"), tokenizer.token_to_id("</s>")
    prompt = "Quote the tag </s> literally, and <s> too"
    treat_special_tokens(tokenizer, "parse")
    assert eos in tokenizer.encode(prompt).ids
    treat_special_tokens(tokenizer, "text")
    ids = tokenizer.encode(prompt).ids
    assert ids[0] == bos and bos not in ids[1:] and eos not in ids
    assert tokenizer.decode(ids, skip_special_tokens=True).strip() == prompt
    with pytest.raises(ValueError, match="prompt_special_tokens must be one of text, parse"):
        treat_special_tokens(tokenizer, "maybe")


def test_no_prompt_of_at_most_the_token_limit_has_more_characters_than_the_bound(tokenizer):
    """The bound must never refuse a prompt that fits: text made of the vocabulary's longest entries
    has the most characters a token count allows."""
    vocab = tokenizer.get_vocab()
    longest = sorted(vocab, key=len)[-50:]
    text = "".join(tokenizer.decode([vocab[token]]) for token in longest)
    tokens = len(tokenizer.encode(text).ids)
    assert len(text) <= max_prompt_chars(tokenizer, tokens) // 2
    assert max_prompt_chars(tokenizer, 100) == 100 * max(map(len, vocab)) * 2
