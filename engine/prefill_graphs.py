"""Prefills replayed from CUDA graphs, one graph per prompt bucket.

Eager, a prefill is hundreds of kernel launches from Python whatever its length: on the H200 with
the 1B model a 12-token prefill took ~17 ms, almost all of it launch overhead; a replay is one
launch (3 ms, `python -m bench.prefill_graphs`). Two kinds per bucket:

- whole prompt (start 0): causal attention over the bucket itself;
- after a reused prefix (prefix-cache hit, start > 0), for buckets up to `SUFFIX_GRAPH_MAX`, in
  fp16/bf16: the queries sit at `start` + offsets, a device tensor, and flash attention's varlen
  form reads only the first `start + bucket` keys of the staging buffer (`seqused_k`, a device
  tensor too), causal aligned to the end, so one graph serves every start. (Masked attention over
  the whole buffer instead took 250 us per layer on the H200: 7 ms a hit, slower than a miss.)

A graph must not depend on the slot, so its keys and values go to a staging buffer of max_len
positions, and each replay copies the real tokens into the slot (and, for a hit, the slot's
reused prefix into the buffer first): a few tens of MB at device bandwidth, microseconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from engine.model_runner import ModelRunner

SUFFIX_GRAPH_MAX = 512  # hit suffixes are short (the uncached tail): longer ones replay eager


@dataclass(frozen=True)
class _Captured:
    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor  # [1, bucket] static input, zero-padded
    offsets: torch.Tensor  # [1, bucket] 0..bucket-1; held here because the graph reads it
    start: torch.Tensor  # [1] first position computed (0 for whole prompts)
    keys_used: torch.Tensor  # [1] int32: start + bucket, the keys a suffix graph's attention reads
    last: torch.Tensor  # [1] index of the last real token, whose logits come out
    logits: torch.Tensor  # [vocab] static output
    held: tuple[torch.Tensor, ...]  # other tensors the graph reads, alive as long as it is


class PrefillGraphs:
    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self._whole: dict[int, _Captured] = {}
        self._suffix: dict[int, _Captured] = {}
        self._stage: torch.Tensor | None = None  # [layers, 2, kv_heads, max_len, head_dim]
        self.replays = 0

    @property
    def buckets(self) -> tuple[int, ...]:
        return tuple(sorted(self._whole))

    @property
    def suffix_buckets(self) -> tuple[int, ...]:
        return tuple(sorted(self._suffix))

    def capture(self, bucket: int) -> None:
        """Both graphs for `bucket` (the suffix one only up to SUFFIX_GRAPH_MAX)."""
        runner = self.runner
        self._whole[bucket] = self._capture(bucket, after_prefix=False)
        half = runner.dtype in (torch.float16, torch.bfloat16)  # flash attention's dtypes
        if half and bucket <= SUFFIX_GRAPH_MAX and bucket < runner.max_len:
            self._suffix[bucket] = self._capture(bucket, after_prefix=True)

    def replay(self, slot: int, new: list[int], bucket: int, start: int) -> torch.Tensor | None:
        """Logits of the last new token, the slot filled; None when no graph covers this prefill."""
        runner = self.runner
        captured = self._suffix.get(bucket) if start else self._whole.get(bucket)
        if captured is None or start + bucket > runner.max_len:
            return None
        cache, local = runner.slot_cache(slot)
        end = start + len(new)
        if start:
            self._stage[:, :, :, :start] = cache[:, :, local, :, :start]
        captured.ids.zero_()
        captured.ids[0, : len(new)] = torch.tensor(new, dtype=torch.long, device=runner.device)
        captured.start.fill_(start)
        captured.keys_used.fill_(start + bucket)
        captured.last.fill_(len(new) - 1)
        captured.graph.replay()
        self.replays += 1
        cache[:, :, local, :, start:end] = self._stage[:, :, :, start:end]
        return captured.logits.clone()  # the static output is overwritten by the next replay

    @torch.inference_mode()
    def _capture(self, bucket: int, after_prefix: bool) -> _Captured:
        runner = self.runner
        if runner.device.type != "cuda":
            raise RuntimeError("CUDA graphs need a CUDA device")
        device = runner.device
        if self._stage is None:
            shape = (runner.shape.layers, 2, runner.kv_heads, runner.max_len, runner.head_dim)
            self._stage = torch.zeros(shape, dtype=runner.dtype, device=device)
        ids = torch.zeros((1, bucket), dtype=torch.long, device=device)
        offsets = torch.arange(bucket, device=device).unsqueeze(0)
        start = torch.zeros(1, dtype=torch.long, device=device)
        last = torch.zeros(1, dtype=torch.long, device=device)
        keys_used = torch.full((1,), bucket, dtype=torch.int32, device=device)
        # flash varlen's sequence bounds: one query sequence of `bucket`, one key sequence of max_len
        bounds = [torch.tensor([0, n], dtype=torch.int32, device=device) for n in (bucket, runner.max_len)]

        def step() -> torch.Tensor:
            positions = offsets + start
            if after_prefix:
                attend = self._suffix_attention(positions[0], keys_used, *bounds)
            else:
                attend = self._whole_attention(bucket)
            hidden = runner.run_layers(ids, positions, attend)
            return runner.logits(hidden[0].index_select(0, last))[0]

        graph, logits = runner.record_graph(step)
        return _Captured(graph, ids, offsets, start, keys_used, last, logits, tuple(bounds))

    def _whole_attention(self, bucket: int):
        runner, stage = self.runner, self._stage

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            stage[layer, 0, :, :bucket] = k[0]
            stage[layer, 1, :, :bucket] = v[0]
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=runner.scaling, enable_gqa=runner.gqa
            )

        return attend

    def _suffix_attention(
        self, positions: torch.Tensor, keys_used: torch.Tensor, seq_q: torch.Tensor, seq_k: torch.Tensor
    ):
        runner, stage = self.runner, self._stage
        bucket, max_len = positions.shape[0], runner.max_len

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            stage[layer, 0].index_copy_(1, positions, k[0])
            stage[layer, 1].index_copy_(1, positions, v[0])
            out = torch.ops.aten._flash_attention_forward(
                q[0].transpose(0, 1),  # varlen layout: [tokens, heads, head_dim]
                stage[layer, 0].transpose(0, 1),
                stage[layer, 1].transpose(0, 1),
                seq_q,
                seq_k,
                bucket,
                max_len,
                0.0,
                True,
                False,
                scale=runner.scaling,
                seqused_k=keys_used,
            )[0]
            return out.transpose(0, 1).unsqueeze(0)

        return attend
