"""Page-locked host memory of exactly the size asked for.

`torch.empty(..., pin_memory=True)` goes through torch's caching host allocator, which rounds every
allocation up to the next power of two: an L2 of 6 GiB would pin 8 GiB, and one of 17 GiB pin 32,
memory that no other process (nor the cgroup limit that `cache_sizing` checks against) can have. An
ordinary allocation whose pages `cudaHostRegister` locks is pinned at its exact size, and device copies
out of and into it are as asynchronous as with the allocator's memory.
"""

from __future__ import annotations

import math
import mmap
import weakref

import torch


def page_locked_empty(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
    """An uninitialized host tensor of exactly its size (to the page), and whether its pages are locked.
    The pages are an anonymous mapping of their own: registering a range that shares a page with another
    registered allocation (as two small `malloc`s can) is refused. When CUDA refuses anyway the memory
    stays pageable (copies then stage and wait) rather than falling back to torch's allocator, whose
    rounding would break the size `cache_sizing` checked."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype), False
    pages = mmap.mmap(-1, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)
    tensor = torch.frombuffer(pages, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)
    return tensor, register(tensor, len(pages))


def register(tensor: torch.Tensor, span: int) -> bool:
    """Lock the `span` bytes of whole pages that `tensor` starts on, for DMA, until it is garbage-collected;
    False when CUDA refuses. The pages are the tensor's own: a page shared with another allocation that is
    registered too would make CUDA refuse the second registration."""
    if not torch.cuda.is_available():
        return False
    cudart = torch.cuda.cudart()
    pointer = tensor.data_ptr()
    if int(cudart.cudaHostRegister(pointer, span, 0)) != 0:
        clear = getattr(cudart, "cudaGetLastError", None)  # not bound by every torch build
        if clear is not None:
            clear()  # else the failed call's error would surface at the next kernel launch's check
        return False
    release = weakref.finalize(tensor, _unregister, pointer)
    release.atexit = False  # at exit the process's teardown frees it, CUDA's context possibly first
    return True


def _unregister(pointer: int) -> None:
    """Unlock once no queued copy can still touch the pages: unlike torch's pinned allocator, which keeps
    a block until the events of its copies complete, nothing else waits for them here."""
    for device in range(torch.cuda.device_count()):
        torch.cuda.synchronize(device)
    torch.cuda.cudart().cudaHostUnregister(pointer)
