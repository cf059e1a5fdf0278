"""What a stage reads of the batch: DeepSpeed's data loader sharded over the stage DAG's replicas,
and the ``LOAD`` handler.

Every stage that reads graph inputs and the output stage (labels) read the batch, each keeping
what it needs: the graph inputs its layers read (``spec.loads``), the labels on the output stage,
and with per-stage degrees only this rank's rows of each (:func:`my_rows`). Every reading rank
checks the whole batch, so a malformed batch fails on all of them instead of leaving a peer
waiting.

Representative signatures::

    stage_loader(engine, dataset, *, start=0) -> RepeatingLoader
    load_micro_batch(engine, buffer_id)     # the LOAD handler of the engine's dispatch table
"""

from __future__ import annotations

import torch
from deepspeed.runtime.dataloader import RepeatingLoader

from ..errors import GPPConfigError
from ..schedule.ir import Buffer
from . import compat
from .backward import reentrant_checkpointing

__all__ = ["ResumingSampler", "stage_loader", "place_data_iter", "load_micro_batch", "split_inputs", "my_rows"]


class ResumingSampler(torch.utils.data.Sampler):
    """An unshuffled ``DistributedSampler`` whose first epoch starts at sample ``start`` of the
    global order: replica ``rank`` takes ``start + rank, start + rank + R, ...`` (padded as the
    ``DistributedSampler`` pads, by repeating the epoch's first samples, so every replica takes as
    many); the epochs after it are the ``DistributedSampler``'s own."""

    def __init__(self, dataset_len: int, *, num_replicas: int, rank: int, start: int = 0):
        self.dataset_len, self.num_replicas, self.rank = dataset_len, num_replicas, rank
        self.start = start % dataset_len if dataset_len else 0
        self._full = torch.utils.data.distributed.DistributedSampler(range(dataset_len), num_replicas=num_replicas,
                                                                     rank=rank, shuffle=False)

    def _first(self) -> list[int]:
        order = list(range(self.start, self.dataset_len))
        pad = -len(order) % self.num_replicas
        order += (order * (pad // max(len(order), 1) + 1))[:pad]
        return order[self.rank::self.num_replicas]

    def __iter__(self):
        if self.start:
            first, self.start = self._first(), 0
            return iter(first)
        return iter(self._full)

    def __len__(self) -> int:
        return len(self._first()) if self.start else len(self._full)

    def set_epoch(self, epoch: int) -> None:
        self._full.set_epoch(epoch)


def stage_loader(engine, dataset, *, start: int = 0) -> RepeatingLoader:
    """DeepSpeed's pipeline loader, sharded over replicas of the stage DAG rather than over a
    stage's data-parallel group.

    DeepSpeed's own (``PipelineEngine._build_data_iter``) samples over the data-parallel group
    with batches of this rank's micro-batch size. With per-stage degrees the ranks of a stage of
    several take row shards of one micro-batch, so every rank of a replica reads the same
    micro-batches of ``b`` rows (a ``DistributedSampler`` over the replicas, unshuffled) and
    :func:`load_micro_batch` keeps this rank's rows. With one rank per stage the replicas are
    the data-parallel group and this is DeepSpeed's loader exactly. ``start``: the samples of the
    data's global order consumed already (a resumed run, :mod:`.elastic`); its first epoch begins
    at the next one."""
    placement = engine.module.placement
    if start % len(dataset):
        sampler = ResumingSampler(len(dataset), num_replicas=placement.replicas, rank=engine.grid.replica_id,
                                  start=start)
    else:
        sampler = torch.utils.data.distributed.DistributedSampler(dataset, num_replicas=placement.replicas,
                                                                  rank=engine.grid.replica_id, shuffle=False)
    rows = engine.train_micro_batch_size_per_gpu() * placement.pipeline().dp[engine.stage_id]
    return RepeatingLoader(engine.deepspeed_io(dataset, batch_size=rows, data_sampler=sampler))


def place_data_iter(engine) -> None:
    """Give ``training_data=``'s loader to the stages that read batches in the DAG.

    DeepSpeed's constructor built it for the linear stages 0 and S-1 (``is_first/last_stage``
    were linear then). Every stage that reads graph inputs, and the output stage (labels), needs
    the loader of :func:`stage_loader`: a ``DistributedSampler`` over the replicas of the
    stage DAG, unshuffled, so the stages of one pipeline read the same samples in the same order
    and the replicas read disjoint shards, as on a chain."""
    if engine.is_first_stage() or engine.is_last_stage():
        if engine.data_iterator is None:
            engine.set_dataloader(stage_loader(engine, engine.training_data))
    else:
        engine.data_iterator = None


def split_inputs(names, inputs) -> dict[str, torch.Tensor]:
    """The batch's inputs by graph input name (``names``, in order)."""
    values = (inputs, ) if torch.is_tensor(inputs) else inputs
    if not isinstance(values, (tuple, list)) or len(values) != len(names) or not all(
            torch.is_tensor(v) for v in values):
        got = (f"a {type(inputs).__name__} of {len(values)}" if isinstance(values, (tuple, list)) else
               f"a {type(inputs).__name__}")
        raise GPPConfigError(f"the batch inputs must be {len(names)} tensor(s) {list(names)} "
                             f"(a tensor when there is one input, else a tuple in that order), got {got}")
    return dict(zip(names, values))


def load_micro_batch(engine, buffer_id: int) -> None:
    """``LOAD``: read the next micro-batch and keep what this rank needs of it."""
    try:
        batch = engine.rooms.next_batch()
    except StopIteration:
        raise GPPConfigError(
            f"data_iter ran out of micro-batches: a batch reads gradient_accumulation_steps={engine.micro_batches} "
            "of them; give it that many, or evaluate fewer with eval_batch(..., num_micro_batches=k)") from None
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise GPPConfigError(f"data_iter must yield (inputs, labels) pairs, got {type(batch).__name__}"
                             + (f" of {len(batch)} elements" if isinstance(batch, (tuple, list)) else ""))
    inputs, labels = batch
    values = split_inputs(engine.module.graph.input_names, inputs)
    placement, stage, idx = engine.placement, engine.stage, engine.grid.stage_idx
    if engine.spec.loads:
        loaded = {}
        for name in engine.spec.loads:
            t = my_rows(values[name], placement.dp, stage=stage, idx=idx, what=f'graph input "{name}"')
            t = t.clone().detach().to(engine.device)
            if reentrant_checkpointing(engine.module):
                t.requires_grad = t.is_floating_point()
            loaded[name] = t
        engine.pipe_buffers[Buffer.LOADED, buffer_id] = loaded
    if engine.is_last_stage():
        if torch.is_tensor(labels):
            labels = my_rows(labels, placement.dp, stage=stage, idx=idx, what="labels").to(engine.device)
        elif isinstance(labels, (tuple, list)):
            labels = tuple(my_rows(x, placement.dp, stage=stage, idx=idx, what="labels").to(engine.device).detach()
                           for x in labels)
        engine.pipe_buffers[Buffer.LABELS, buffer_id] = labels


def my_rows(tensor: torch.Tensor, degrees, *, stage: int, idx: int, what: str) -> torch.Tensor:
    """Rank ``idx``'s row shard of a micro-batch tensor on ``stage`` (all of it on a stage of one
    rank; ``degrees``: every stage's rank count)."""
    degree = degrees[stage]
    if degree == 1:
        return tensor
    rows = tensor.shape[0] if tensor.dim() else 0
    if rows == 0 or rows % degree:
        raise GPPConfigError(f"stage {stage} runs on {degree} ranks, each taking an equal share of the "
                             f"micro-batch's rows, but {what} has shape {tuple(tensor.shape)}; make the "
                             f"micro-batch a multiple of every stage degree {list(degrees)}")
    size = rows // degree
    return tensor[idx * size:(idx + 1) * size]
