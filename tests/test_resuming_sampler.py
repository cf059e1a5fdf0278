"""The data position of a resumed run (issue 31): ``ResumingSampler`` deals the samples after the
first ``start`` of the global order as an unshuffled ``DistributedSampler`` deals the whole epoch,
so two worlds of different sizes together read every sample once."""

import pytest
import torch

from gpp_deepspeed.engine.data import ResumingSampler


def dealt(sampler_of, replicas, batch):
    """The samples each step of ``batch`` per replica reads, replica by replica, as DeepSpeed's loader does."""
    per_replica = [list(sampler_of(r)) for r in range(replicas)]
    steps = -(-len(per_replica[0]) // batch)   # the last batch may be short (DeepSpeed keeps it)
    return [sorted(i for r in range(replicas) for i in per_replica[r][s * batch:(s + 1) * batch]) for s in range(steps)]


@pytest.mark.parametrize("before,after", [(1, 2), (3, 2), (2, 4)])
def test_two_worlds_read_every_sample_of_the_epoch_once(before, after):
    n, batch = 48, 2   # each replica reads 2 samples per step; a step is 2 x replicas samples
    first = dealt(lambda r: torch.utils.data.distributed.DistributedSampler(range(n), num_replicas=before, rank=r,
                                                                            shuffle=False), before, batch)
    consumed = first[:3]   # three steps, then the world changes
    start = 3 * batch * before
    assert sorted(i for s in consumed for i in s) == list(range(start)), "steps take consecutive samples"
    second = dealt(lambda r: ResumingSampler(n, num_replicas=after, rank=r, start=start), after, batch)
    assert sorted(i for s in consumed + second for i in s) == list(range(n))


def test_the_epochs_after_the_resumed_one_are_the_distributed_samplers():
    sampler = ResumingSampler(10, num_replicas=2, rank=1, start=4)
    assert len(sampler) == 3 and list(sampler) == [5, 7, 9]
    assert list(sampler) == list(torch.utils.data.distributed.DistributedSampler(range(10), num_replicas=2, rank=1,
                                                                                 shuffle=False))
