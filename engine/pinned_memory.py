"""Page-locked host memory of exactly the size asked for.

`torch.empty(..., pin_memory=True)` goes through torch's caching host allocator, which rounds every
allocation up to the next power of two: an L2 of 6 GiB pins 8 GiB, and one of 17 GiB pins 32, memory no
other process (nor the cgroup's limit that `cache_sizing` checks) can have. An ordinary allocation whose
pages `cudaHostRegister` locks is pinned exactly, and device copies out of and into it are as
asynchronous as with the allocator's memory.
"""

from __future__ import annotations

import weakref

import torch


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized host tensor, page-locked at its exact size; falls back to torch's pinned allocator
    (rounded up) when registration fails, so a host that cannot register still gets pinned memory."""
    tensor = torch.empty(shape, dtype=dtype)
    if tensor.numel() == 0 or not register(tensor):
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    return tensor


def register(tensor: torch.Tensor) -> bool:
    """Lock `tensor`'s pages for DMA until it is garbage-collected; False when CUDA refuses."""
    cudart = torch.cuda.cudart()
    pointer = tensor.data_ptr()
    if int(cudart.cudaHostRegister(pointer, tensor.numel() * tensor.element_size(), 0)) != 0:
        clear = getattr(cudart, "cudaGetLastError", None)  # not bound by every torch build
        if clear is not None:
            clear()  # else the failed call's error would surface at the next kernel launch's check
        return False
    weakref.finalize(tensor, cudart.cudaHostUnregister, pointer)
    return True
