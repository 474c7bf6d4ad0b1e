"""Forward passes over a Llama-family checkpoint with KV memory allocated once, per batch slot.

Why not `model.generate` or transformers' ContinuousBatchingManager: generate() grows its cache
every step and batches only requests that start together; the CB manager (5.17) picks greedy or
sampling for the whole manager and draws from the global RNG, so per-request sampling parameters
and reproducible seeds under batching are impossible there. This runner reuses the checkpoint's
own modules (embeddings, projections, norms, MLP, rotary embedding) and owns only the attention
over a static slot cache, which keeps decode shapes fixed (CUDA-graph friendly) and lets
requests join and leave between steps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from engine.prefill_graphs import PrefillGraphs

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@torch.library.custom_op("llm_engine::write_decode_kv", mutates_args=("cache",))
def write_decode_kv(
    cache: torch.Tensor,
    layer: int,
    slots: torch.Tensor,
    positions: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """The decode step's KV write as one opaque op for torch.compile. Traced as plain indexing, the
    write into a view of the slot cache (a graph input) is functionalized into a copy of the whole
    cache per layer (measured: compiled decode 40 ms vs 2 ms eager on the tiny model); as a custom op
    that declares its mutation, inductor writes in place."""
    cache[layer, 0, slots, :, positions] = k
    cache[layer, 1, slots, :, positions] = v


@write_decode_kv.register_fake
def _write_decode_kv_fake(cache, layer, slots, positions, k, v) -> None:
    return None


@dataclass(frozen=True)
class KVShape:
    layers: int
    slots: int
    kv_heads: int
    max_len: int
    head_dim: int

    def bytes(self, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * self.layers * self.slots * self.kv_heads * self.max_len * self.head_dim * element


@dataclass(frozen=True)
class SlotPool:
    """Global slots [first, first + slots) share one cache tensor of `capacity` positions each."""

    first: int
    slots: int
    capacity: int
    cache: torch.Tensor  # [layers, 2, slots, kv_heads, capacity, head_dim]
    local: torch.Tensor  # arange(slots) on the device: the decode step's KV write index


class ModelRunner:
    """Prefill and decode over a slot cache: slot `s` holds one request's keys and values.

    The slots may be split into pools of different capacities (length classes, planned by
    scheduler/kv_pools.py): each pool is one tensor allocated here, once. Global slot numbers run
    through the pools in order, shortest capacity first.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        slots: int,
        max_len: int,
        kv_buckets: tuple[int, ...],
        pools: Sequence[tuple[int, int]] | None = None,
    ):
        config = model.config
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {config.model_type!r} is not supported by the slot engine; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        self.model = model
        self.decoder = model.model
        self.vocab_size = model.get_input_embeddings().num_embeddings  # ids the embedding can look up
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        attn = self.decoder.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        self.num_heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.gqa = self.kv_heads != self.num_heads  # grouped-query attention: SDPA's enable_gqa
        limit = getattr(config, "max_position_embeddings", max_len) or max_len
        self.max_len = min(max_len, limit)
        self.kv_buckets = tuple(b for b in kv_buckets if b < self.max_len) + (self.max_len,)
        self.shape = KVShape(len(self.decoder.layers), slots, self.kv_heads, self.max_len, self.head_dim)
        self.pools = self._allocate_pools(pools or ((self.max_len, slots),))
        self._slot_pool = [
            (pool, slot - pool.first)
            for pool in self.pools
            for slot in range(pool.first, pool.first + pool.slots)
        ]
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._graph_logits: dict[int, torch.Tensor] = {}
        self._graph_pool = None
        self._graph_tokens = self._graph_positions = None
        self.use_cuda_graphs = False
        self.use_prefill_graphs = False
        self.prefill_graphs = PrefillGraphs(self)
        self._compiled_decode = None
        self.compiled_buckets: set[int] = set()
        self.compile_fallbacks = 0  # compiled-bucket steps that ran eagerly (a guard failed)

    @property
    def slots(self) -> int:
        return self.shape.slots

    @property
    def kv_bytes(self) -> int:
        return sum(pool.cache.nbytes for pool in self.pools)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.kv_bytes // sum(pool.capacity * pool.slots for pool in self.pools)

    @property
    def widest_slot(self) -> int:
        """A slot of the longest capacity (warmup shapes and template prefills go there)."""
        return self.slots - 1

    def last_positions(self, kv_len: int) -> torch.Tensor:
        """Every slot at the last position a `kv_len` decode step reaches in its pool (dummy steps)."""
        last = [min(kv_len, pool.capacity) - 1 for pool in self.pools for _ in range(pool.slots)]
        return torch.tensor(last, dtype=torch.long, device=self.device)

    def graph_pool(self):
        """One memory pool for every CUDA graph (decode and prefill): they never replay concurrently."""
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        return self._graph_pool

    def slot_cache(self, slot: int) -> tuple[torch.Tensor, int]:
        """The pool tensor holding `slot` and the slot's index in it."""
        pool, local = self._slot_pool[slot]
        return pool.cache, local

    def slot_capacity(self, slot: int) -> int:
        return self._slot_pool[slot][0].capacity

    def clear(self) -> None:
        for pool in self.pools:
            pool.cache.zero_()

    def _allocate_pools(self, pools: Sequence[tuple[int, int]]) -> tuple[SlotPool, ...]:
        plan = sorted((min(capacity, self.max_len), count) for capacity, count in pools if count > 0)
        if sum(count for _, count in plan) != self.slots or plan[-1][0] != self.max_len:
            raise ValueError(
                f"KV pools {pools} must hold {self.slots} slots and end at the sequence limit {self.max_len}"
            )
        allocated, first = [], 0
        for capacity, count in plan:
            shape = (self.shape.layers, 2, count, self.kv_heads, capacity, self.head_dim)
            cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            allocated.append(SlotPool(first, count, capacity, cache, torch.arange(count, device=self.device)))
            first += count
        return tuple(allocated)

    def bucket(self, length: int, buckets: tuple[int, ...] | None = None) -> int:
        for size in buckets or self.kv_buckets:
            if size >= length:
                return size
        raise ValueError(f"length {length} exceeds the engine limit {self.max_len}")

    @torch.inference_mode()
    def prefill(self, slot: int, token_ids: list[int], padded_len: int, start: int = 0) -> torch.Tensor:
        """Fill `slot` with the prompt's keys/values; returns the last prompt position's logits [V].

        The tokens from `start` on are computed (the ones before are already in the slot, loaded
        from the prefix cache), right-padded to `padded_len` so that only bucketed shapes reach the
        kernels; causal attention keeps padding from influencing real tokens, and decode
        overwrites the padded positions before anything reads them.
        """
        new = token_ids[start:]
        padded_len = min(padded_len, self.slot_capacity(slot) - start)
        logits = self.prefill_graphs.replay(slot, new, padded_len, start)
        if logits is not None:
            return logits
        ids = torch.zeros((1, padded_len), dtype=torch.long, device=self.device)
        ids[0, : len(new)] = torch.tensor(new, dtype=torch.long, device=self.device)
        positions = torch.arange(start, start + padded_len, device=self.device).unsqueeze(0)
        hidden = self.run_layers(ids, positions, self._prefill_attention(slot, start, padded_len))
        return self.logits(hidden[:, len(new) - 1])[0]

    def read_blocks(self, slot: int, count: int, block_size: int) -> torch.Tensor:
        """The slot's first `count` blocks as [count, layers, 2, kv_heads, block_size, head_dim]."""
        pool, local = self._slot_pool[slot]
        span = pool.cache[:, :, local, :, : count * block_size]
        blocks = span.reshape(*span.shape[:3], count, block_size, self.head_dim)
        return blocks.permute(3, 0, 1, 2, 4, 5)

    def write_blocks(self, slot: int, blocks: torch.Tensor) -> None:
        """Inverse of read_blocks: place cached prefix blocks at the start of `slot`."""
        count, block_size = blocks.shape[0], blocks.shape[4]
        span = blocks.permute(1, 2, 3, 0, 4, 5).reshape(*blocks.shape[1:4], count * block_size, self.head_dim)
        pool, local = self._slot_pool[slot]
        pool.cache[:, :, local, :, : count * block_size] = span

    @torch.inference_mode()
    def decode(self, last_tokens: torch.Tensor, positions: torch.Tensor, kv_len: int) -> torch.Tensor:
        """One token for every slot: `last_tokens` and `positions` are [slots]; returns logits [slots, V].

        Every slot is computed (idle ones at position 0) so the shape depends only on `kv_len`,
        the bucket that covers the longest active sequence. With a captured CUDA graph for that
        bucket the step is one replay instead of hundreds of kernel launches from Python; the
        returned logits then live in the graph's static buffer until the next replay.
        """
        graph = self._graphs.get(kv_len)
        if graph is None:
            return self._decode_step(kv_len)(last_tokens, positions, kv_len)
        self._graph_tokens.copy_(last_tokens)
        self._graph_positions.copy_(positions)
        graph.replay()
        return self._graph_logits[kv_len]

    @property
    def graph_buckets(self) -> tuple[int, ...]:
        return tuple(sorted(self._graphs))

    def _decode_step(self, kv_len: int):
        """The decode function for `kv_len`: compiled when `compile_decode(kv_len)` succeeded, else
        eager. A bucket that was not compiled never reaches torch.compile at serving time, so a new
        bucket can never trigger a multi-second compile in the middle of traffic."""
        if kv_len in self.compiled_buckets:
            return self._decode_compiled
        return self._decode_eager

    def _decode_compiled(
        self, last_tokens: torch.Tensor, positions: torch.Tensor, kv_len: int
    ) -> torch.Tensor:
        """The compiled step; should a guard ever fail at serving time (inputs unlike those compiled
        for), that step runs eagerly instead of compiling, and `compile_fallbacks` counts it. The
        guard check raises before anything runs, so the eager step starts from the same state."""
        try:
            with torch.compiler.set_stance("fail_on_recompile"):
                return self._compiled_decode(last_tokens, positions, kv_len)
        except RuntimeError as exc:
            if "Detected recompile" not in str(exc):
                raise
        self.compile_fallbacks += 1
        return self._decode_eager(last_tokens, positions, kv_len)

    def compile_decode(self, kv_len: int) -> None:
        """Compile the decode step for `kv_len` with torch.compile (inductor, static shapes, one graph)
        by running it on dummy data (it overwrites slot contents: warmup only), then check with a
        second step that the compiled code is reused without recompiling. Raises on any failure and
        leaves the bucket eager. Inductor's own CUDA graphs stay off (default mode): on CUDA the
        compiled step is what `capture_decode_graph` records, so compile before capturing.

        The inputs are ordinary tensors, like the engine's (and the CUDA graphs' static inputs):
        Dynamo guards on tensor kind, and inference tensors would compile a specialization that
        serving never uses (measured: every bucket compiled twice).
        """
        if self._compiled_decode is None:
            # Every bucket is a specialization of the same code object; keep them all.
            dynamo = torch._dynamo.config
            dynamo.recompile_limit = max(dynamo.recompile_limit, 4 * len(self.kv_buckets) + 8)
            self._compiled_decode = torch.compile(self._decode_compilable, dynamic=False, fullgraph=True)
        with torch.inference_mode(False):
            tokens = torch.ones(self.slots, dtype=torch.long, device=self.device)
            positions = self.last_positions(kv_len)
        with torch.inference_mode():
            self._compiled_decode(tokens, positions, kv_len)
            with torch.compiler.set_stance("fail_on_recompile"):
                self._compiled_decode(tokens, positions, kv_len)
        self.compiled_buckets.add(kv_len)

    def _decode_compilable(
        self, last_tokens: torch.Tensor, positions: torch.Tensor, kv_len: int
    ) -> torch.Tensor:
        return self._decode_eager(last_tokens, positions, kv_len, opaque_kv_write=True)

    @torch.inference_mode()
    def capture_decode_graph(self, kv_len: int) -> None:
        """Record the decode step for `kv_len` as a CUDA graph (all buckets share one memory pool)."""
        if self.device.type != "cuda":
            raise RuntimeError("CUDA graphs need a CUDA device")
        if self._graph_tokens is None:
            with torch.inference_mode(False):  # ordinary tensors, as compile_decode compiled for
                self._graph_tokens = torch.zeros(self.slots, dtype=torch.long, device=self.device)
                self._graph_positions = torch.zeros(self.slots, dtype=torch.long, device=self.device)
        step = self._decode_step(kv_len)
        graph, logits = self.record_graph(lambda: step(self._graph_tokens, self._graph_positions, kv_len))
        self._graph_logits[kv_len] = logits
        self._graphs[kv_len] = graph

    def record_graph(self, step: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Capture `step` as a CUDA graph in the shared pool: one warm run on a side stream, the
        capture, then one replay (the first launch uploads the graph: not on a request's time).
        Returns the graph and its static output."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.graph_pool()):
            output = step()
        graph.replay()
        return graph, output

    def _decode_eager(
        self, last_tokens: torch.Tensor, positions: torch.Tensor, kv_len: int, opaque_kv_write: bool = False
    ) -> torch.Tensor:
        ids = last_tokens.view(-1, 1)
        pos = positions.view(-1, 1)
        visible = torch.arange(kv_len, device=self.device).unsqueeze(0) <= pos
        mask = visible[:, None, None, :]
        attend = self._decode_attention(pos.view(-1), kv_len, mask, opaque_kv_write)
        hidden = self.run_layers(ids, pos, attend)
        return self.logits(hidden[:, -1])

    def warm_shape(self, kind: str, bucket: int) -> None:
        """Run one kernel shape with dummy data: a prefill padded to `bucket` (into the widest slot),
        the prefill graphs of `bucket` ("prefill_graph"), or a decode step over `bucket` keys
        (captured as a CUDA graph when `use_cuda_graphs`). Only for warmup or an idle engine: it
        overwrites slot contents."""
        if kind == "prefill_graph":
            self.prefill_graphs.capture(bucket)
        elif kind == "prefill":
            self.prefill(self.widest_slot, [1] * min(bucket, self.max_len - 1), bucket)
        elif self.use_cuda_graphs:
            self.capture_decode_graph(bucket)
        else:
            tokens = torch.ones(self.slots, dtype=torch.long, device=self.device)
            self.decode(tokens, self.last_positions(bucket), bucket)

    def _prefill_attention(self, slot: int, start: int, padded_len: int):
        """Causal attention for the new tokens; after a reused prefix (`start` > 0) the queries sit
        at the end of the keys, which `causal_lower_right` expresses without a materialized mask, so
        CUDA runs it with the flash kernel (heads expanded: flash takes equal head counts). The CPU
        kernels take no such bias: SDPA would build the mask again in every layer (a tril and a where), so
        there it is built once, as an additive mask (256 new tokens after 1,616, tiny model, CPU VM:
        23.7-23.8 -> 22.6-23.0 ms a prefill)."""
        pool, local = self._slot_pool[slot]
        cache = pool.cache
        end = start + padded_len
        offset = None
        if start:
            offset = causal_lower_right(padded_len, end)
            if cache.device.type == "cpu":
                allowed = offset._materialize(cache.device)
                offset = torch.zeros(allowed.shape, dtype=cache.dtype).masked_fill_(~allowed, float("-inf"))

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            cache[layer, 0, local, :, start:end] = k[0]
            cache[layer, 1, local, :, start:end] = v[0]
            if offset is None:
                return F.scaled_dot_product_attention(
                    q, k, v, is_causal=True, scale=self.scaling, enable_gqa=self.gqa
                )
            keys = self.expand_heads(cache[layer, 0, local, :, :end].unsqueeze(0))
            values = self.expand_heads(cache[layer, 1, local, :, :end].unsqueeze(0))
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=offset, scale=self.scaling)

        return attend

    def expand_heads(self, kv: torch.Tensor) -> torch.Tensor:
        """Repeat KV heads for grouped-query attention. Under an explicit mask, SDPA's GQA mode falls
        back to the math kernel (every score materialized: ~5 ms on a 3.5k-token prefix on the
        H200); with expanded heads the memory-efficient kernel takes the mask."""
        groups = self.num_heads // self.kv_heads
        return kv if groups == 1 else kv.repeat_interleave(groups, dim=1)

    def _decode_attention(self, positions: torch.Tensor, kv_len: int, mask: torch.Tensor, opaque_write: bool):
        """Each pool attends over its own slots, up to the smaller of `kv_len` and its capacity (both
        are KV buckets, so every pool's shape is fixed by `kv_len`: one graph per bucket still)."""
        spans = [
            (pool, slice(pool.first, pool.first + pool.slots), min(kv_len, pool.capacity))
            for pool in self.pools
        ]

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            outputs = []
            for pool, rows, length in spans:
                cache, at = pool.cache, positions[rows]
                if opaque_write:  # compiled path (see write_decode_kv); eager skips the op's dispatch cost
                    write_decode_kv(cache, layer, pool.local, at, k[rows, :, 0], v[rows, :, 0])
                else:
                    cache[layer, 0, pool.local, :, at] = k[rows, :, 0]
                    cache[layer, 1, pool.local, :, at] = v[rows, :, 0]
                outputs.append(
                    F.scaled_dot_product_attention(
                        q[rows],
                        cache[layer, 0, :, :, :length],
                        cache[layer, 1, :, :, :length],
                        attn_mask=mask[rows, ..., :length],
                        scale=self.scaling,
                        enable_gqa=self.gqa,
                    )
                )
            return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

        return attend

    def run_layers(self, ids: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        hidden = self.decoder.embed_tokens(ids)
        cos, sin = self.decoder.rotary_emb(hidden, positions)
        batch, steps = ids.shape
        for index, layer in enumerate(self.decoder.layers):
            residual = hidden
            normed = layer.input_layernorm(hidden)
            attn = layer.self_attn
            q = attn.q_proj(normed).view(batch, steps, -1, self.head_dim)
            k = attn.k_proj(normed).view(batch, steps, -1, self.head_dim)
            v = attn.v_proj(normed).view(batch, steps, -1, self.head_dim).transpose(1, 2)
            if hasattr(attn, "q_norm"):
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            out = attend(index, q, k, v).transpose(1, 2).reshape(batch, steps, -1)
            hidden = residual + attn.o_proj(out)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return self.decoder.norm(hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(hidden).float()
