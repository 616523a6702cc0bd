"""GlobalBatchSampler: the same global batches for any world size, every validation sample exactly once."""

import pytest

from project.data.sampling import EpochShuffle, GlobalBatchSampler


def sampler(num_samples, batch_size, rank=0, world_size=1, shuffle=False, seed=0, drop_last=False, epoch=0):
    """The sampler's batches, as index lists (it yields tensors of indices)."""
    order = EpochShuffle(num_samples, shuffle=shuffle, seed=seed)
    order.set_epoch(epoch)
    return [batch.tolist() for batch in GlobalBatchSampler(order, batch_size, rank, world_size, drop_last=drop_last)]


def rank_batches(num_samples, batch_size, world_size, **kwargs):
    """Each rank's batches, as lists of index lists."""
    return [list(sampler(num_samples, batch_size, rank, world_size, **kwargs)) for rank in range(world_size)]


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("epoch", [0, 1])
def test_training_global_batches_do_not_depend_on_world_size(world_size, epoch):
    global_batches = list(sampler(1000, 8 * world_size, shuffle=True, seed=7, drop_last=True, epoch=epoch))
    per_rank = rank_batches(1000, 8, world_size, shuffle=True, seed=7, drop_last=True, epoch=epoch)
    assert len(global_batches) == 1000 // (8 * world_size)
    for step, global_batch in enumerate(global_batches):
        parts = [per_rank[rank][step] for rank in range(world_size)]
        assert all(len(part) == 8 for part in parts)
        assert sum(parts, []) == global_batch  # rank r holds the r-th slice, in order


def test_shuffle_changes_with_epoch_and_repeats_with_seed():
    first = list(sampler(100, 10, shuffle=True, seed=3, drop_last=True))
    assert first == list(sampler(100, 10, shuffle=True, seed=3, drop_last=True))
    assert list(sampler(100, 10, shuffle=True, seed=3, drop_last=True, epoch=1)) != first
    assert sorted(sum(first, [])) == list(range(100))


def test_training_drops_only_the_incomplete_global_batch():
    batches = rank_batches(103, 5, 2, shuffle=True, drop_last=True)
    assert [len(b) for b in batches] == [10, 10]
    assert len(set(sum(batches[0] + batches[1], []))) == 100


@pytest.mark.parametrize(
    "num_samples,batch_size,world_size", [(103, 5, 2), (10, 4, 3), (7, 100, 4), (64, 8, 4), (5, 1, 2), (9, 2, 4)]
)
def test_evaluation_sees_every_sample_once_with_equal_batch_counts(num_samples, batch_size, world_size):
    batches = rank_batches(num_samples, batch_size, world_size)
    assert len({len(b) for b in batches}) == 1  # every rank runs the same number of steps
    seen = [i for rank in batches for batch in rank for i in batch]
    assert sorted(seen) == list(range(num_samples))
    # Never empty; one sample over batch_size only where the set cannot be split evenly otherwise.
    assert all(1 <= len(batch) <= batch_size + 1 for rank in batches for batch in rank)


def test_too_few_samples_are_refused():
    with pytest.raises(ValueError, match="cannot fill one global batch"):
        sampler(10, 8, 0, 2, drop_last=True)
    with pytest.raises(ValueError, match="cannot give each of 4 ranks one"):
        sampler(3, 8, 0, 4)
