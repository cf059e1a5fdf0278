"""Where per-stage degrees reach into DeepSpeed's private internals (DeepSpeed 0.19.8), in one place.

Two things DeepSpeed does not let a caller choose through its public API:

* ``PipelineModule.__init__`` builds its process grid with ``PipelineParallelGrid(...)``, looked up
  by name in ``deepspeed.runtime.pipe.module``; :func:`pipeline_grid` routes that one construction
  to :class:`~gpp_deepspeed.engine.topology.StageGrid` while the parent constructor runs.
* The ZeRO-1/2 optimizer sums the gradient norm over its data-parallel group, then over the
  model-parallel group (``_model_parallel_all_reduce``). With per-stage degrees the model-parallel
  group is a whole replica of the stage DAG, where a stage of ``n`` ranks would be counted ``n``
  times; :func:`count_each_stage_once` makes only one rank per stage contribute to sums.

``tests/test_placement.py`` pins the DeepSpeed version these were written against.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import deepspeed
from deepspeed import comm as dist
import deepspeed.runtime.pipe.module as _ds_pipe_module

__all__ = ["DEEPSPEED_VERSION", "pipeline_grid", "count_each_stage_once"]

DEEPSPEED_VERSION = "0.19.8"  # the version whose internals this module reaches into


@contextlib.contextmanager
def pipeline_grid(factory: Callable):
    """While active, ``PipelineModule.__init__`` gets its grid from ``factory(process_group=...,
    topology=...)`` instead of DeepSpeed's cartesian ``PipelineParallelGrid``."""
    original = _ds_pipe_module.PipelineParallelGrid
    _ds_pipe_module.PipelineParallelGrid = factory
    try:
        yield
    finally:
        _ds_pipe_module.PipelineParallelGrid = original


def count_each_stage_once(optimizer, *, is_stage_leader: bool, group) -> None:
    """Make a ZeRO-1/2 optimizer's norm reduction over the model-parallel ``group`` count every
    stage once: after its data-parallel sum each rank of a stage holds the stage's total, so only
    the stage's leader adds it in (``MAX`` reductions, overflow checks, are unchanged)."""
    if not hasattr(optimizer, "_model_parallel_all_reduce"):
        return

    def reduce(tensor, op):
        if op == dist.ReduceOp.SUM and not is_stage_leader:
            tensor.zero_()
        dist.all_reduce(tensor=tensor, op=op, group=group)

    optimizer._model_parallel_all_reduce = reduce


def installed_version() -> str:
    return deepspeed.__version__
