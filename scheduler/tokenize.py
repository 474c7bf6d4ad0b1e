"""Prompt text to token ids for the scheduler step, on the cheapest path the tokenizer offers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def ids_encoder(tokenizer: Any) -> Callable[[str], list[int]]:
    """`text -> ids` through `encode_batch_fast` where the `tokenizers` version has it: the same ids
    without tracking character offsets, which the step never reads. Measured on the CPU VM at 1800
    tokens: 1.16 ms against 1.55 ms for `encode` (2.8 against 3.2 ms when the call follows an idle gap,
    as a request does). Older versions fall back to `encode`."""
    fast = getattr(tokenizer, "encode_batch_fast", None)
    if fast is None:
        return lambda text: tokenizer.encode(text).ids
    return lambda text: fast([text])[0].ids
