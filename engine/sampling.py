"""Per-request token selection: greedy, or temperature/top-k/top-p with the request's own RNG.

Each sampled request owns a torch.Generator seeded from its `seed`, so its tokens do not depend
on which other requests share the batch.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch

from scheduler.messages import MIN_TEMPERATURE


class Sampler:
    """Selection state of one request."""

    def __init__(self, temperature: float, top_p: float, top_k: int, seed: int | None, device: torch.device):
        self.temperature = temperature
        self.top_p = top_p
        self.top_k = top_k
        self.generator: torch.Generator | None = None
        if temperature >= MIN_TEMPERATURE:
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
            drop[0] = (
                False  # the most likely token always stays: a top_p float32 rounds to 0 dropped them all
            )
            scores = scores.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))


@dataclass
class PendingPicks:
    """A step's token choices, the greedy ones possibly still on their way to the host."""

    logits: torch.Tensor
    samplers: dict[int, Sampler]
    greedy: torch.Tensor | list[int]
    copied: torch.cuda.Event | None = None

    @property
    def in_flight(self) -> bool:
        """Whether the device still computes them: host work done now overlaps the device's."""
        return self.copied is not None

    def result(self) -> dict[int, int]:
        """Next token for each slot in `samplers` (`settle`); the first pick that raised is raised."""
        tokens, faults = self.settle()
        if faults:
            raise next(iter(faults.values()))
        return tokens

    def settle(self) -> tuple[dict[int, int], dict[int, Exception]]:
        """Next token for each slot in `samplers`, and apart the exception of each slot whose pick raised
        (NaN/inf probabilities), so that one request's fault is not every slot's. Waits for the argmax
        only, not for device work queued after it (a prefix store's copies), then picks the sampled
        slots."""
        if self.copied is not None:
            self.copied.synchronize()
        greedy = self.greedy if isinstance(self.greedy, list) else self.greedy.tolist()
        tokens: dict[int, int] = {}
        faults: dict[int, Exception] = {}
        for slot, s in self.samplers.items():
            try:
                tokens[slot] = greedy[slot] if s.greedy else s.pick(self.logits[slot])
            except Exception as exc:
                faults[slot] = exc
        return tokens, faults


class TokenPicker:
    """Queues a step's greedy argmax and its copy to host without waiting for them.

    The engine thread then does host work (prefix stores) while the device computes the step, and
    its wait ends when the argmax lands. A `.tolist()` of the argmax also waited for every copy the
    store had queued behind the step (its demotion to L2 crosses PCIe)."""

    def __init__(self, rows: int, device: torch.device):
        self._host: torch.Tensor | None = None
        self._event: torch.cuda.Event | None = None
        if device.type == "cuda":
            self._host = torch.empty(rows, dtype=torch.int64, pin_memory=True)
            self._event = torch.cuda.Event()

    def launch(self, logits: torch.Tensor, samplers: dict[int, Sampler]) -> PendingPicks:
        """`logits` [rows, V]; the buffer is reused: read each launch's result before the next launch."""
        greedy = torch.argmax(logits, dim=-1)
        if self._host is None or self._event is None:
            return PendingPicks(logits, samplers, greedy.tolist())
        host = self._host[: greedy.shape[0]]
        host.copy_(greedy, non_blocking=True)
        self._event.record()
        return PendingPicks(logits, samplers, host, self._event)


def warm_sampling(vocab_size: int, slots: int, device: torch.device) -> int:
    """One greedy and one top-k/top-p pick on random logits: the sampling path's kernels loaded before
    the first request needs them (the warmup's sampling stage and engine/device_prewarm.py)."""
    logits = torch.randn(slots, vocab_size, device=device)
    samplers = [Sampler(0.0, 1.0, 0, None, device), Sampler(0.8, 0.9, 40, 0, device)]
    for sampler in samplers:
        sampler.pick(logits[0])
    return len(samplers)
