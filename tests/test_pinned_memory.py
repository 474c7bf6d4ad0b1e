"""engine.pinned_memory on any host: exact, page-aligned, usable; locked only where CUDA is (see
tests/test_engine_cuda.py for the locked case)."""

import mmap

import torch

from engine.pinned_memory import page_locked_empty


def test_the_tensor_has_its_shape_on_pages_of_its_own_and_holds_values():
    tensor, locked = page_locked_empty((3, 5, 7), torch.bfloat16)
    assert tensor.shape == (3, 5, 7) and tensor.dtype == torch.bfloat16 and tensor.is_contiguous()
    assert tensor.data_ptr() % mmap.PAGESIZE == 0
    tensor.copy_(torch.arange(105, dtype=torch.bfloat16).view(3, 5, 7))
    assert float(tensor.sum()) == float(torch.arange(105, dtype=torch.bfloat16).sum())
    assert locked == torch.cuda.is_available()


def test_an_empty_shape_is_an_empty_unlocked_tensor():
    tensor, locked = page_locked_empty((0, 4), torch.float16)
    assert tensor.shape == (0, 4) and not locked
