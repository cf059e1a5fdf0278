"""DeepSpeed's process grid for a stage DAG whose stages have their own data-parallel degrees.

DeepSpeed's ``PipeDataParallelTopology`` and ``PipelineParallelGrid`` are a cartesian grid: every
stage on the same number of ranks. :class:`StageGrid` answers the same queries from a
:class:`~gpp_deepspeed.graph.placement.Placement`, for the asking rank's own stage:

=================================  ===========================================================
DeepSpeed query                    answer for a rank of stage ``s`` in replica ``r``
=================================  ===========================================================
``get_data_parallel_group``        every rank of ``s`` with this rank's TP rank, in every
                                   replica (``dp_s * R`` ranks): gradient all-reduce, ZeRO-1
                                   partitions, the loss average; TP peers are not in it
``get_data_parallel_rank``         its position in that group (checkpoint writers, ZeRO files)
``get_pipe_parallel_group``        every rank of replica ``r`` (the loss broadcast)
``get_model_parallel_group``       the same replica group (DeepSpeed's uniform grid uses the
                                   ranks of one pipeline, pipe x model, for the same purpose:
                                   the gradient norm and the overflow check)
``get_model_parallel_rank``        ``s`` without TP, else ``sum(tp[:s]) + tp rank`` (names
                                   checkpoint files ``mp_rank_<..>``, as DeepSpeed's grid does)
``get_slice_parallel_group``       the TP group of this rank's row shard (``tp_s`` adjacent
                                   ranks); also ``get_tensor_model_parallel_group``, the name
                                   Megatron's ``mpu`` gives it, for layers doing their own TP
``stage_to_global(t)``             the first rank of stage ``t`` in replica ``r``
=================================  ===========================================================

With every degree 1 these are exactly DeepSpeed's groups, and with a uniform TP degree (DeepSpeed's
``PipeModelDataParallelTopology``) too, rank for rank. :class:`StageTopology` is the
``ProcessTopology`` stand-in that ``PipelineModule`` and its checkpoint naming query.
"""

from __future__ import annotations

from collections import namedtuple

from deepspeed import comm as dist

from ..errors import GPPConfigError
from ..graph.placement import Placement, RankPlace

__all__ = ["StageTopology", "StageGrid", "stage_batch_config", "check_tp_composes"]

ProcessCoord = namedtuple("ProcessCoord", ["pipe", "data"])
ProcessCoord3D = namedtuple("ProcessCoord3D", ["pipe", "data", "model"])


class StageTopology:
    """The ``ProcessTopology`` queries ``PipelineModule`` asks, answered from a placement.

    A rank's ``data`` coordinate is its position in its stage's data-parallel group; with tensor
    parallelism its ``model`` coordinate is its TP rank (DeepSpeed's checkpoint files are named
    ``layer_XX-model_YY`` by it).
    """

    def __init__(self, placement: Placement):
        self.placement = placement

    def get_dim(self, axis: str) -> int:
        if axis == "pipe":
            return self.placement.num_stages
        if axis == "model" and len(set(self.placement.tp)) == 1:
            return self.placement.tp[0]
        return 0  # no cartesian data axis: degrees differ per stage (DeepSpeed returns 0 for absent axes)

    def get_axis_names(self) -> list[str]:
        return ["pipe", "data", "model"] if self.placement.has_tp else ["pipe", "data"]

    def get_coord(self, rank: int):
        place = self.placement.locate(rank)
        data = self.placement.data_group(place.stage, place.tp_idx).index(rank)
        if self.placement.has_tp:
            return ProcessCoord3D(pipe=place.stage, data=data, model=place.tp_idx)
        return ProcessCoord(pipe=place.stage, data=data)

    def get_rank_repr(self, rank, omit_axes=("data", "pipe"), inner_sep="_", outer_sep="-") -> str:
        axes = [a for a in self.get_axis_names() if a not in omit_axes]
        coord = self.get_coord(rank)
        return outer_sep.join(f"{a}{inner_sep}{getattr(coord, a):02d}" for a in axes)

    def world_size(self) -> int:
        return self.placement.world_size

    def __str__(self) -> str:
        return (f"StageTopology(degrees={list(self.placement.degrees)}, tp={list(self.placement.tp)}, "
                f"replicas={self.placement.replicas})")


class StageGrid:
    """DeepSpeed's ``PipelineParallelGrid`` interface over per-stage degrees (see the module doc).

    Every rank creates every group, in the same order (``new_group`` is collective).
    """

    def __init__(self, placement: Placement, topology: StageTopology | None = None):
        self.placement = placement
        self._topo = topology or StageTopology(placement)
        self.global_rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.place: RankPlace = placement.locate(self.global_rank)
        self.stage_id = self.place.stage
        self.replica_id = self.place.replica
        self.pipe_parallel_size = placement.num_stages
        self.tp_idx = self.place.tp_idx
        self.model_parallel_size = self.slice_parallel_size = placement.tp[self.stage_id]
        for s in range(placement.num_stages):
            for t in range(placement.tp[s]):
                ranks = list(placement.data_group(s, t))
                group = dist.new_group(ranks=ranks)
                if (s, t) == (self.stage_id, self.tp_idx):
                    self.dp_group, self.dp_proc_group = ranks, group
        for k in range(placement.replicas):
            ranks = list(placement.replica_group(k))
            group = dist.new_group(ranks=ranks)
            if k == self.replica_id:
                self.pp_group, self.pp_proc_group = ranks, group
        # One slice (TP) group per row shard; without tensor slicing one per rank, as DeepSpeed's grid.
        for s in range(placement.num_stages):
            for k in range(placement.replicas):
                for d in range(placement.dp[s]):
                    ranks = list(placement.tp_group(s, k, d))
                    group = dist.new_group(ranks=ranks)
                    if self.global_rank in ranks:
                        self.slice_group, self.slice_proc_group = ranks, group
        self.data_parallel_size = len(self.dp_group)
        self.data_parallel_id = self.dp_group.index(self.global_rank)
        self.ds_model_proc_group = self.pp_proc_group
        self.ds_model_rank = sum(placement.tp[:self.stage_id]) + self.tp_idx
        self.ds_model_world_size = sum(placement.tp)
        self.is_first_stage = self.stage_id == 0
        self.is_last_stage = self.stage_id == placement.num_stages - 1
        self.p2p_groups: list = []  # DeepSpeed's p2p groups are only built for torch < 1.8

    @property
    def stage_idx(self) -> int:
        """This rank's row shard among its stage's in its replica (its index there without TP)."""
        return self.place.dp_idx

    @property
    def tp_leader(self) -> int:
        """The global rank of TP rank 0 of this rank's row shard (it sends and receives the
        stage's activations and gradients; see :mod:`.transfers`)."""
        return self.slice_group[0]

    def stage_ranks(self, stage: int) -> tuple[int, ...]:
        """The ranks of ``stage`` in this rank's replica, by index."""
        return self.placement.ranks(stage, self.replica_id)

    def stage_to_global(self, stage_id, **kwargs):
        """The first rank of ``stage_id`` in this rank's replica."""
        return self.stage_ranks(stage_id)[0]

    def is_stage_leader(self) -> bool:
        """True on the first rank of this stage in this replica (it speaks for the stage once;
        under TP, for the stage's replicated parameters: each TP rank of row shard 0 speaks for
        its own slice, :meth:`is_shard_leader`)."""
        return self.place.idx == 0

    def is_shard_leader(self) -> bool:
        """True on every rank of this stage's row shard 0 in this replica: together they hold
        the stage's parameters once (each TP rank its slice)."""
        return self.place.dp_idx == 0

    def topology(self):
        return self._topo

    def get_stage_id(self):
        return self.stage_id

    def get_data_parallel_id(self):
        return self.data_parallel_id

    def get_global_rank(self):
        return self.global_rank

    def get_pipe_parallel_rank(self):
        return self.stage_id

    def get_pipeline_model_parallel_rank(self):
        return self.stage_id

    def get_pipe_parallel_world_size(self):
        return self.pipe_parallel_size

    def get_pipeline_model_parallel_world_size(self):
        return self.pipe_parallel_size

    def get_pipe_parallel_group(self):
        return self.pp_proc_group

    def get_data_parallel_rank(self):
        return self.data_parallel_id

    def get_data_parallel_world_size(self):
        return self.data_parallel_size

    def get_data_parallel_group(self):
        return self.dp_proc_group

    def get_data_parallel_group_ranks(self):
        return self.dp_group

    def get_model_parallel_rank(self):
        return self.ds_model_rank

    def get_model_parallel_world_size(self):
        return self.ds_model_world_size

    def get_model_parallel_group(self):
        return self.ds_model_proc_group

    def get_slice_parallel_rank(self):
        return self.tp_idx

    def get_tensor_model_parallel_rank(self):
        return self.tp_idx

    def get_slice_parallel_world_size(self):
        return self.slice_parallel_size

    def get_tensor_model_parallel_world_size(self):
        return self.slice_parallel_size

    def get_slice_parallel_group(self):
        """This rank's TP group: what a stage's tensor-parallel layers all-reduce over."""
        return self.slice_proc_group

    def get_tensor_model_parallel_group(self):
        return self.slice_proc_group


def check_tp_composes(placement: Placement, *, schedule: str, asynchronous: bool, stages_per_rank: int = 1,
                      config_tp=None) -> None:
    """Refuse, by name and on every rank before any communication, what does not compose with
    tensor parallelism yet (nothing when every stage has TP degree 1): an asynchronous schedule
    (its in-pipeline updates and weight predictions are untested on TP slices), several stages per
    rank (folds: a rank's stages would need one TP group each), and a ``graph_pipeline.stage_tp``
    that is not the module's (the module built the process groups from its own)."""
    tp = list(placement.tp)
    if config_tp is not None and list(config_tp) != tp:
        raise GPPConfigError(f"graph_pipeline.stage_tp {list(config_tp)} is not the module's TP degrees {tp}: the "
                             "module builds the process groups, so pass stage_tp= (or the topology, or a plan) to "
                             "GraphPipelineModule and give the config the same list, or leave it out")
    if not placement.has_tp:
        return
    if asynchronous:
        raise GPPConfigError(f'graph_pipeline.schedule "{schedule}" is asynchronous, which does not compose with '
                             f"tensor parallelism yet (stage_tp {tp}); use a synchronous schedule such as \"1f1b\" "
                             'or "zb1"')
    if stages_per_rank > 1:
        raise GPPConfigError(f"several stages per rank (a fold of {stages_per_rank}) do not compose with tensor "
                             f"parallelism yet (stage_tp {tp}); give each stage its own ranks, or every stage TP 1")


_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def stage_batch_config(config: dict, placement: Placement, stage: int) -> dict:
    """The DeepSpeed batch values for a rank of ``stage``, from the values the user wrote.

    The user writes the config for the pipeline, as with one rank per stage:
    ``train_micro_batch_size_per_gpu`` is the micro-batch ``b`` one copy of the stage DAG
    processes, ``gradient_accumulation_steps`` the micro-batches ``M`` per step and
    ``train_batch_size`` = ``b * M * replicas`` (any two of the three, as DeepSpeed accepts). A rank
    of a stage of degree ``n`` really processes ``b / n`` rows per micro-batch in a data-parallel
    group of ``n * replicas`` ranks, and that is what its DeepSpeed engine is told, so DeepSpeed's
    own checks (``train_batch_size == micro * GAS * dp``) and averages hold on every rank.

    >>> p = Placement.build((2, 1), world_size=3)
    >>> stage_batch_config({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, p, 0)
    {'train_micro_batch_size_per_gpu': 2, 'gradient_accumulation_steps': 2, 'train_batch_size': 8}
    """
    if all(n == 1 for n in placement.dp):
        return dict(config)  # one rank per stage: DeepSpeed's own meaning, untouched
    replicas = placement.replicas
    tb, b, m = (config.get(k) for k in _BATCH_KEYS)
    if b is None and tb is not None:
        m = m or 1
        b = tb // (m * replicas)
    if b is None:
        raise GPPConfigError("per-stage degrees need the pipeline micro-batch: set train_micro_batch_size_per_gpu "
                             "(or train_batch_size)")
    if m is None:
        m = tb // (b * replicas) if tb is not None else 1
    if tb is not None and tb != b * m * replicas:
        raise GPPConfigError(f"train_batch_size ({tb}) must be train_micro_batch_size_per_gpu ({b}) x "
                             f"gradient_accumulation_steps ({m}) x replicas of the stage DAG ({replicas})")
    placement.check_micro_batch(b)
    out = {k: v for k, v in config.items() if k not in _BATCH_KEYS}
    out.update(train_micro_batch_size_per_gpu=b // placement.dp[stage], gradient_accumulation_steps=m,
               train_batch_size=b * m * replicas)
    return out
