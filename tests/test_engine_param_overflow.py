"""Found in review (2026-12-07): max_batch_size past what a tensor size can hold (10**30) failed the load with
torch's `TypeError: zeros(): ... Overflow when unpacking long long`, naming no parameter; 10**9 already
gets "the KV slots ... do not fit ...; lower max_batch_size or max_seq_len"."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.loader import load_engine
from tests.test_engine_config_limits import BASE as LIMITS_BASE

BASE = LIMITS_BASE | {"warmup": "false", "min_batch_size": "1"}


@pytest.mark.parametrize("slots", [str(10**30), str(2**63)])
def test_max_batch_size_past_a_tensor_size_names_the_parameter(slots):
    with pytest.raises(ValueError, match="max_batch_size"):  # refused by the config or at load
        load_engine(EngineConfig.from_parameters({**BASE, "max_batch_size": slots}), log=lambda m: None)
