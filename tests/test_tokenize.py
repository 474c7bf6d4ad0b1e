"""The scheduler's fast tokenization path gives exactly the ids of `encode`."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from scheduler.tokenize import ids_encoder
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
        def encode(self, text):
            return tokenizer.encode(text)

    assert ids_encoder(Plain())("fallback path") == tokenizer.encode("fallback path").ids
