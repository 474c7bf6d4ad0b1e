"""Row selectors for the block pools (L1 on the device, L2 in host memory).

A store, a demotion or a load selects a few pool rows. Rows handed out in ascending order are mostly
one run (a prompt's blocks are allocated, and evicted, together), and a run is a slice: a view, with
no index tensor and no gather. Otherwise the index tensor is built in pinned memory and sent without
blocking: `torch.tensor(rows, device="cuda")` is a synchronous copy from pageable memory, measured at
~56 us each on the H200 host, two per store. `copy_rows` copies rows between pools (or from a slot's
blocks) by run when there are few runs, for every tier: L1 stores, L2 demotions and L2 promotions.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch


def is_run(rows: Sequence[int]) -> bool:
    """Whether `rows` are consecutive and ascending."""
    if not rows or rows[-1] - rows[0] != len(rows) - 1:
        return False
    return all(b - a == 1 for a, b in zip(rows, rows[1:]))


def select(rows: Sequence[int], device: torch.device) -> slice | torch.Tensor:
    """What indexes `rows` of a pool on `device`: a slice for a run, else an index tensor there."""
    if is_run(rows):
        return slice(rows[0], rows[-1] + 1)
    index = torch.tensor(list(rows), dtype=torch.int64, pin_memory=device.type == "cuda")
    return index.to(device, non_blocking=True)


def runs(pairs: Sequence[tuple[int, int]]) -> Iterator[tuple[int, int, int]]:
    """Maximal runs of (destination, source) row pairs where both step by one, as (destination start,
    source start, length): a run is one copy instead of one per row. `pairs` in any order."""
    ordered = sorted(pairs)
    start = 0
    for i in range(1, len(ordered) + 1):
        if i == len(ordered) or ordered[i] != (ordered[i - 1][0] + 1, ordered[i - 1][1] + 1):
            yield ordered[start][0], ordered[start][1], i - start
            start = i


MAX_RUN_COPIES = 4  # beyond this many runs, one gather and one scatter cost less host time


def copy_rows(
    dest: torch.Tensor,
    dest_rows: Sequence[int],
    source: torch.Tensor,
    source_rows: Sequence[int],
    *,
    max_runs: float | None = None,
    non_blocking: bool = False,
) -> None:
    """dest[dest_rows[i]] = source[source_rows[i]] for every i. With at most `max_runs` runs of rows
    consecutive on both sides (None: MAX_RUN_COPIES; math.inf: any number), one copy per run, each a
    slice (no index tensor, no gather); else one gather, moved to `dest`'s device and dtype, and one
    scatter. `non_blocking`: the per-run copies are asynchronous (pinned host memory and a device)."""
    spans = list(runs(list(zip(dest_rows, source_rows))))
    if len(spans) <= (MAX_RUN_COPIES if max_runs is None else max_runs):
        for to, start, count in spans:
            dest[to : to + count].copy_(source[start : start + count], non_blocking=non_blocking)
        return
    gathered = source[select(source_rows, source.device)]
    dest[select(dest_rows, dest.device)] = gathered.to(dest.device, dest.dtype)
