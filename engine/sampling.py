"""Per-request token selection: greedy, or temperature/top-k/top-p with the request's own RNG.

Each sampled request owns a torch.Generator seeded from its `seed`, so its tokens do not depend
on which other requests share the batch.
"""

from __future__ import annotations

import secrets

import torch


class Sampler:
    """Selection state of one request."""

    def __init__(self, temperature: float, top_p: float, top_k: int, seed: int | None, device: torch.device):
        self.temperature = temperature
        self.top_p = top_p
        self.top_k = top_k
        self.generator: torch.Generator | None = None
        if temperature > 0.0:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(seed if seed is not None else secrets.randbits(63))

    @property
    def greedy(self) -> bool:
        return self.generator is None

    def pick(self, logits: torch.Tensor) -> int:
        """Choose the next token from one row of logits [V]."""
        if self.generator is None:
            return int(torch.argmax(logits))
        scores = logits / self.temperature
        if 0 < self.top_k < scores.numel():
            kth = torch.topk(scores, self.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if self.top_p < 1.0:
            ordered, order = torch.sort(scores, descending=True)
            cumulative = torch.softmax(ordered, dim=-1).cumsum(dim=-1)
            drop = cumulative - torch.softmax(ordered, dim=-1) >= self.top_p
            scores = scores.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))


def pick_tokens(logits: torch.Tensor, samplers: dict[int, Sampler]) -> dict[int, int]:
    """Next token for each slot in `samplers`; greedy slots share one argmax over the batch."""
    greedy = torch.argmax(logits, dim=-1).tolist()
    return {slot: greedy[slot] if s.greedy else s.pick(logits[slot]) for slot, s in samplers.items()}


def warm_sampling(vocab_size: int, slots: int, device: torch.device) -> int:
    """One greedy and one top-k/top-p pick on random logits: the sampling path's kernels loaded before
    the first request needs them (the warmup's sampling stage and engine/device_prewarm.py)."""
    logits = torch.randn(slots, vocab_size, device=device)
    samplers = [Sampler(0.0, 1.0, 0, None, device), Sampler(0.8, 0.9, 40, 0, device)]
    for sampler in samplers:
        sampler.pick(logits[0])
    return len(samplers)
