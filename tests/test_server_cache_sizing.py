"""Cache tiers sized in bytes through a real server: a tier that cannot fit fails the load, naming its
parameter, instead of an out-of-memory error or a swapping host."""

from __future__ import annotations

import pytest

from deploy.launch import StackError, StackOptions, start_stack
from tests.conftest import MODEL_DIR


def test_an_l2_larger_than_the_host_fails_the_load_naming_the_parameter(tmp_path):
    overrides = {"llm_engine": {"l2_cache_memory": "1000TiB"}}
    options = StackOptions(run_dir=tmp_path / "stack", model_dir=MODEL_DIR, warmup=False, overrides=overrides)
    with pytest.raises(StackError) as failed:
        stack = start_stack(options)
        stack.stop()
    assert "l2_cache_memory" in str(failed.value) and "does not fit" in str(failed.value)
