import math

import pytest
import torch

from engine.block_rows import copy_rows, is_run, runs, select


@pytest.mark.parametrize(
    "rows, expected",
    [([3, 4, 5], True), ([7], True), ([], False), ([5, 4, 3], False), ([1, 2, 4], False), ([1, 3, 2], False)],
)
def test_only_ascending_consecutive_rows_are_a_run(rows, expected):
    assert is_run(rows) is expected


def test_a_run_selects_a_view_and_other_rows_the_same_rows_by_index():
    pool = torch.arange(20.0).reshape(10, 2)
    run = select([2, 3, 4], pool.device)
    assert run == slice(2, 5)
    view = pool[run]
    view[0, 0] = -1.0
    assert pool[2, 0] == -1.0  # a view: no gather
    scattered = select([6, 1, 8], pool.device)
    assert isinstance(scattered, torch.Tensor)
    torch.testing.assert_close(pool[scattered], torch.stack([pool[6], pool[1], pool[8]]))


def test_runs_group_pairs_that_step_together_whatever_their_order():
    pairs = [(11, 1), (10, 0), (12, 2), (20, 3), (5, 4), (6, 5), (30, 9)]
    assert list(runs(pairs)) == [(5, 4, 2), (10, 0, 3), (20, 3, 1), (30, 9, 1)]
    assert list(runs([])) == []


@pytest.mark.parametrize("max_runs", [0, 2, math.inf], ids=["gather-scatter", "runs-or-gather", "runs"])
def test_copy_rows_puts_each_source_row_at_its_destination_by_either_path(max_runs):
    source = torch.arange(10, dtype=torch.float32).view(10, 1).expand(10, 3)
    dest = torch.zeros(12, 3, dtype=torch.float64)
    dest_rows, source_rows = [7, 8, 9, 0, 1, 4], [2, 3, 4, 8, 9, 0]  # three runs
    copy_rows(dest, dest_rows, source, source_rows, max_runs=max_runs)
    expected = torch.zeros(12, 3, dtype=torch.float64)
    for to, start in zip(dest_rows, source_rows):
        expected[to] = source[start]
    assert torch.equal(dest, expected)
