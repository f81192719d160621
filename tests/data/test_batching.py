"""Deterministic, resumable epoch order split across ranks."""

from __future__ import annotations

import pytest

from tidal.data import DataError, epoch_permutation, micro_batches, step_batches


def test_ranks_are_disjoint_and_cover_each_global_batch():
    n, global_batch, world = 37, 8, 4
    per_rank = [
        step_batches(n, global_batch, seed=3, epoch=0, world_size=world, rank=r) for r in range(world)
    ]
    order = epoch_permutation(n, 3, 0)
    assert all(len(steps) == n // global_batch for steps in per_rank)  # drop_last
    for step in range(n // global_batch):
        shares = [set(per_rank[r][step]) for r in range(world)]
        assert all(len(s) == global_batch // world for s in shares)
        assert set().union(*shares) == set(order[step * global_batch : (step + 1) * global_batch])
        assert sum(len(s) for s in shares) == global_batch  # disjoint


def test_deterministic_and_different_across_epochs():
    assert step_batches(50, 10, seed=1, epoch=2) == step_batches(50, 10, seed=1, epoch=2)
    assert step_batches(50, 10, seed=1, epoch=2) != step_batches(50, 10, seed=1, epoch=3)
    assert step_batches(50, 10, seed=1, epoch=0) != step_batches(50, 10, seed=2, epoch=0)
    assert sorted(epoch_permutation(50, 1, 7)) == list(range(50))


def test_errors_name_sizes():
    with pytest.raises(DataError, match="5 sample.*global batch of 8"):
        step_batches(5, 8, seed=0, epoch=0)
    with pytest.raises(DataError, match="multiple of the world size 3"):
        step_batches(50, 8, seed=0, epoch=0, world_size=3)
    with pytest.raises(DataError, match="rank 2 is outside"):
        step_batches(50, 8, seed=0, epoch=0, world_size=2, rank=2)


def test_micro_batches():
    assert micro_batches([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]
