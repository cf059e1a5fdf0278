"""Where per-stage degrees reach into DeepSpeed's private internals (DeepSpeed 0.19.8), in one place.

Two things DeepSpeed does not let a caller choose through its public API:

* ``PipelineModule.__init__`` builds its process grid with ``PipelineParallelGrid(...)``, looked up
  by name in ``deepspeed.runtime.pipe.module``; :func:`pipeline_grid` routes that one construction
  to :class:`~gpp_deepspeed.engine.topology.StageGrid` while the parent constructor runs.
* The ZeRO-1/2 optimizer sums the gradient norm over its data-parallel group, then over the
  model-parallel group (``_model_parallel_all_reduce``). With per-stage degrees the model-parallel
  group is a whole replica of the stage DAG, where a stage of ``n`` ranks would be counted ``n``
  times; :func:`count_each_stage_once` makes only one rank per stage contribute to sums.

Optimizer state that moves between layouts (:mod:`.portable`) reads and writes each parameter's
whole state through DeepSpeed's public tensor-fragment API (``deepspeed.utils.safe_get_full_*``);
what that API leaves out is here: which flat partition holds a parameter's group
(:func:`flat_optimizer_groups`), the base optimizer's per-group state such as Adam's step count
(:func:`base_optimizer_state`), and linking the fragments to state created before the first step
(:func:`link_fragment_state`).

An asynchronous schedule's updates happen inside the pipeline, outside DeepSpeed's backward and
step: :func:`hand_grads_to_master` gives DeepSpeed's bf16 optimizer a gradient that reached the
live weights without a backward, and :func:`stage_local_norm` keeps one stage's own update from
summing its norm over the whole pipeline.

ZeRO-2 inside a stage's data-parallel group (:mod:`.zero`): ``PipelineEngine.__init__`` asserts
ZeRO stage < 2 right after DeepSpeed built the optimizer; :func:`pipeline_assert_stage` shows that
one assert stage 1, and every other caller the real stage. DeepSpeed's ZeRO-2 optimizer reduces each
parameter's gradient from its hook during every backward; :func:`reduce_micro_batch_gradients` runs
the epilogue that reduces what is left in its bucket and adds the micro-batch into the partition
(what ``DeepSpeedEngine.backward`` runs after each backward), and :func:`finish_gradient_accumulation`
builds the partitions the step reads (DeepSpeed's own unmanaged-accumulation path).

``PipelineModule._synchronize_tied_weights`` broadcasts each tied weight, a leaf that requires
grad, with autograd recording: torch then warns at the first backward that ``c10d::broadcast_`` has
no autograd kernel. :func:`broadcast_tied_weights` is the same broadcast of the values alone.

The rest of what the engine and module need from DeepSpeed's private side is one named function
each, below the ``# -- named uses`` line: the loss scaling and batch fetch of ``PipelineEngine``,
the flags, timers and epilogue of ``DeepSpeedEngine.backward`` that a backward run outside it must
set or finish, ``PipelineModule``'s layer bounds and specs, and bf16's high-precision gradient.
Overrides of DeepSpeed's private methods (subclassing, the way DeepSpeed itself extends its engine)
are listed in :data:`OVERRIDDEN`. ``tests/test_deepspeed_seam.py`` fails when a DeepSpeed private name
is used anywhere else in the package, and checks that every override still exists upstream.

``tests/test_placement.py`` pins the DeepSpeed version these were written against.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import Callable

import torch

import deepspeed
from deepspeed import comm as dist
from deepspeed.runtime import engine as _ds_engine
import deepspeed.runtime.pipe.module as _ds_pipe_module
from deepspeed.runtime.utils import is_model_parallel_parameter
from deepspeed.runtime.pipe.engine import PipelineEngine as _PipelineEngine
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as _ZeroStage3

__all__ = ["DEEPSPEED_VERSION", "is_model_parallel_parameter", "pipeline_grid", "count_each_stage_once", "flat_optimizer_groups",
           "base_optimizer", "base_optimizer_state", "link_fragment_state", "broadcast_tied_weights",
           "hand_grads_to_master", "stage_local_norm", "OVERRIDDEN", "scale_loss_by_gas", "next_batch",
           "tied_weight_grad", "pipeline_backward_pass", "engine_backward", "stop_started_backward_timers",
           "start_stopped_backward_timers", "backward_epilogue", "backward_graph_tracker",
           "hp_grads_deferred", "comms_logging_enabled", "coalesces_p2p", "configure_python_gc", "set_layer_bounds", "local_layer_bounds", "layer_specs",
           "precompute_checkpointable_values", "pipeline_assert_stage", "reduce_micro_batch_gradients",
           "finish_gradient_accumulation", "optimizer_gradient_tensors", "zero3_trace_checked_within",
           "zero3_stage_partitions"]

DEEPSPEED_VERSION = "0.19.8"  # the version whose internals this module reaches into

#: DeepSpeed private methods that ``GraphPipelineEngine`` / ``GraphPipelineModule`` override, DeepSpeed
#: calling them (the ``_exec_*`` handlers of ``_INSTRUCTION_MAP`` aside): renamed upstream, the
#: override would silently stop running, so the seam test checks each still exists.
OVERRIDDEN = frozenset({
    "_broadcast_model", "_build_data_iter", "_aggregate_total_loss", "_loss_stage_global_rank",
    "_train_schedule", "_inference_schedule", "_reentrant_activation_checkpointing", "_bcast_pipe_scalar",
    "_partition_layers", "_build", "_index_tied_modules",
})


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


def count_each_stage_once(optimizer, *, is_stage_leader: bool, group, tp_rank: int = 0) -> None:
    """Make a ZeRO optimizer's norm reduction over the model-parallel ``group`` count every
    stage once: after its data-parallel sum each rank of a stage holds the stage's total, so only
    the stage's leader adds it in (``MAX`` reductions, overflow checks, are unchanged). ZeRO-3 also
    counts every stage's gradients (not those of model-parallel rank 0 alone) and tied copies once.
    Under tensor parallelism ``is_stage_leader`` is true on every TP rank of the stage's first row
    shard, and a parameter not sliced over the TP group counts on TP rank ``tp_rank`` 0 only."""
    if not hasattr(optimizer, "_model_parallel_all_reduce"):
        return
    # ZeRO-3 counts a parameter's norm only on model-parallel rank 0 (mpu.get_model_parallel_rank(),
    # the stage index here; ZeRO-1/2 ask for the tensor-parallel rank): every stage counts its own.
    if hasattr(optimizer, "model_parallel_rank"):
        optimizer.model_parallel_rank = tp_rank

    def reduce(tensor, op):
        if op == dist.ReduceOp.SUM and not is_stage_leader:
            tensor.zero_()
        dist.all_reduce(tensor=tensor, op=op, group=group)

    optimizer._model_parallel_all_reduce = reduce

    if isinstance(optimizer, _ZeroStage3):
        # ZeRO-1/2 skip the pipeline-replicated copies of tied weights in the norm
        # (``ds_pipe_replicated``); ZeRO-3 does not: count them as zero, so each tie counts once.
        norm = optimizer.get_grad_norm_direct

        def norm_without_replicas(gradients, params, norm_type=2):
            gradients = [torch.zeros_like(g) if getattr(p, "ds_pipe_replicated", False) else g
                         for g, p in zip(gradients, params)]
            return norm(gradients, params, norm_type)

        optimizer.get_grad_norm_direct = norm_without_replicas


def flat_optimizer_groups(optimizer) -> list[tuple[list, "torch.Tensor"]] | None:
    """For an optimizer that keeps fp32 state in flat partitions (ZeRO-1/2's
    ``DeepSpeedZeroOptimizer``, DeepSpeed's ``BF16_Optimizer``): per parameter group, the model
    parameters of the group and this rank's flat fp32 partition (the base optimizer's parameter).
    None for any other optimizer."""
    for lp_name, hp_name in (("bit16_groups", "single_partition_of_fp32_groups"),
                             ("bf16_groups", "fp32_groups_flat_partition")):
        if hasattr(optimizer, lp_name) and hasattr(optimizer, hp_name):
            return list(zip(getattr(optimizer, lp_name), getattr(optimizer, hp_name)))
    return None


def base_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer a ZeRO or bf16 optimizer steps over its flat fp32 partitions."""
    return optimizer.optimizer


def base_optimizer_state(optimizer, flat) -> dict:
    """The base (torch) optimizer's state of the flat partition ``flat``: ``exp_avg`` ... over the
    partition and ``step``, created empty if the optimizer has not stepped yet."""
    return base_optimizer(optimizer).state[flat]


def link_fragment_state(optimizer) -> None:
    """Point every parameter's fragment at the base optimizer's current flat state tensors, as
    DeepSpeed does after its first step (``_lazy_init_hp_params_optimizer_state``), so
    ``safe_set_full_optimizer_state`` writes into state made before any step."""
    optimizer._hp_optimizer_states_linked = False
    optimizer._lazy_init_hp_params_optimizer_state()


def hand_grads_to_master(optimizer) -> None:
    """DeepSpeed's bf16 optimizer keeps fp32 gradients beside its fp32 master weights and adds a
    backward's low-precision gradients into them (``_update_hp_grad``, which also links the tied
    weights' ``_hp_grad``). An asynchronous schedule's gradient reaches the live weights by
    ``RETIRE``, not by a backward: add it the same way (whether ``immediate_grad_update`` is on or
    not) and drop the low-precision copy. Nothing to do for any other optimizer."""
    groups = getattr(optimizer, "bf16_groups", None)
    if groups is None:
        return
    for i, group in enumerate(groups):
        for j, lp in enumerate(group):
            if lp.grad is not None:
                optimizer._update_hp_grad(lp, i, j, clear_lp_grads=False)
                lp.grad = None


@contextlib.contextmanager
def stage_local_norm(optimizer):
    """While active, DeepSpeed's bf16 optimizer computes the gradient norm (its overflow check, and
    clipping) over this rank's gradients only, instead of summing it over its ``mpu``'s
    model-parallel group, a whole replica of the pipeline here: an asynchronous schedule's own
    update is one stage's, at a time no other stage meets (the stage's data-parallel ranks hold the
    same reduced gradients, so they agree)."""
    if getattr(optimizer, "mpu", None) is None:
        yield
        return
    mpu, optimizer.mpu = optimizer.mpu, None
    try:
        yield
    finally:
        optimizer.mpu = mpu


def pipeline_assert_stage(stage: int) -> int:
    """The ZeRO stage to report to the caller of ``zero_optimization_stage()`` two frames up: 1
    (for a ZeRO stage of 2) to ``PipelineEngine.__init__``, whose assert "ZeRO-2 and ZeRO-3 are
    incompatible with pipeline parallelism" is the one thing it does with the stage; the real
    stage to everyone else (DeepSpeed's optimizer set-up ran before, with the real one)."""
    if stage >= 2 and sys._getframe(2).f_code is _PipelineEngine.__init__.__code__:
        return 1
    return stage


def reduce_micro_batch_gradients(optimizer) -> None:
    """After one micro-batch's backward on a ZeRO-2 optimizer: reduce the gradients still in its
    bucket over the data-parallel group and add this rank's share into its gradient partition, as
    ``DeepSpeedEngine.backward`` does after each backward (``overlapping_partition_gradients_reduce_epilogue``).
    The accumulation boundary is off, so the partition keeps accumulating; a backward that reached no
    parameter of this stage set up no bucket and has nothing to reduce."""
    if not getattr(optimizer, "ready_for_gradients", True):
        return
    optimizer.set_gradient_accumulation_boundary(False)
    optimizer.overlapping_partition_gradients_reduce_epilogue()
    # ZeRO-3 counts micro-batches at the next forward (copy the first, add the others); a stage may
    # run two backwards with no forward between (GPipe, a pipeline's cool-down): count it now.
    optimizer.clear_backward_seen_flag()


def finish_gradient_accumulation(optimizer) -> None:
    """At the end of a batch: give a ZeRO-2 optimizer the flat gradient partitions its step (and
    ``safe_get_full_grad``) reads, from what the micro-batches accumulated."""
    if not hasattr(optimizer, "params_in_partition"):   # ZeRO-3: its partitions are ready
        optimizer.finalize_gradient_accumulation_boundary()
        return
    for i, params in enumerate(optimizer.params_in_partition):
        if i not in optimizer.all_grad_tensors or optimizer.all_grad_tensors[i] is None:
            # no micro-batch reached this group on this rank: its gradient is zero
            optimizer.all_grad_tensors[i] = optimizer.get_all_grad_tensors(params,
                                                                           dtype=optimizer.gradient_accumulation_dtype)
    optimizer.finalize_gradient_accumulation_boundary()


def optimizer_gradient_tensors(optimizer):
    """The tensors in which a ZeRO-1/2 or bf16 optimizer holds gradients, besides the parameters'
    ``.grad``: the flat fp32 partitions' ``.grad``, bf16's fp32 accumulators, and ZeRO-2's reduce
    buckets, accumulated partitions (``all_grad_tensors``, ``averaged_gradients``) and
    ``grads_in_partition``. For measuring memory (``benchmarks/zero_memory.py``)."""
    groups = flat_optimizer_groups(optimizer) or []
    yield from (flat.grad for _, flat in groups if flat.grad is not None)
    for name in ("fp32_groups_gradients_flat", ):   # BF16_Optimizer
        yield from (t for t in getattr(optimizer, name, ()) if torch.is_tensor(t))
    for name in ("all_grad_tensors", "averaged_gradients"):
        for tensors in (getattr(optimizer, name, None) or {}).values():
            yield from (t for t in tensors or () if torch.is_tensor(t))
    if torch.is_tensor(getattr(optimizer, "grads_in_partition", None)):
        yield optimizer.grads_in_partition
    if torch.is_tensor(getattr(optimizer, "grad_partitions_flat_buffer", None)):   # ZeRO-3
        yield optimizer.grad_partitions_flat_buffer
    for bucket in (getattr(optimizer, "ipg_buckets", None) or {}).values():
        buffer = bucket.buffer
        yield from ([buffer] if torch.is_tensor(buffer) else buffer or ())


@contextlib.contextmanager
def zero3_trace_checked_within(group):
    """While active, ZeRO-3's parameter coordinator checks that the ranks agree on the order its trace
    recorded over ``group`` (the stage's data-parallel group) instead of over all ranks.

    ``PartitionedParameterCoordinator.reset_step`` runs at the start of every forward of the stage
    module and, while its trace is incomplete, calls ``assert_ints_same_as_other_ranks``: a
    ``dist.broadcast`` from rank 0 over the world. The stages of a pipeline reach their forwards at
    different times, between point-to-point transfers, and hold different modules, so that check
    deadlocks (rank 0 waits in it while the next stage waits for rank 0's activations) or would fail;
    the ranks of one stage run the same program and must agree, and are checked (ids relative to
    the first of the list: step numbers and ids counted from where the process's counter stood)."""
    from deepspeed.runtime.zero import partitioned_param_coordinator as coordinator
    original = coordinator.assert_ints_same_as_other_ranks

    def same_on_stage(ints) -> None:
        # ZeRO-3 numbers modules and parameters from a process-wide counter: a process that built
        # other engines before numbers the same stage apart, by a constant, so compare relative ids.
        ints = list(ints)
        gathered = [None] * torch.distributed.get_world_size(group=group)
        torch.distributed.all_gather_object(gathered, [i - ints[0] for i in ints], group=group)
        if any(g != gathered[0] for g in gathered):
            raise RuntimeError(f"ZeRO-3's module trace differs between the ranks of a stage: {gathered}")

    coordinator.assert_ints_same_as_other_ranks = same_on_stage
    try:
        yield
    finally:
        coordinator.assert_ints_same_as_other_ranks = original


def zero3_stage_partitions(params) -> list:
    """This rank's partition of each ZeRO-3 parameter (``ds_tensor``), for measuring memory."""
    return [getattr(p, "ds_tensor", p) for p in params]


def broadcast_tied_weights(tied_comms: dict) -> None:
    """Give every copy of each tied weight the value of the first rank holding it, as
    ``PipelineModule._synchronize_tied_weights`` does (at construction and after loading a
    checkpoint), but outside autograd: the copy is an initial value, not an operation to
    differentiate, so no graph node is recorded on the leaf and backward never reaches it."""
    with torch.no_grad():
        for comm in tied_comms.values():
            for attr in comm["weight_attr"]:
                weight = functools.reduce(getattr, attr.split("."), comm["module"])
                dist.broadcast(weight.detach(), src=min(comm["ranks"]), group=comm["group"])


def installed_version() -> str:
    return deepspeed.__version__


# -- named uses of DeepSpeed 0.19.8's private side by the engine and the module ---------------------


def scale_loss_by_gas(engine, loss):
    """``loss`` divided by the gradient accumulation steps, as DeepSpeed reports a batch's loss."""
    return engine._scale_loss_by_gas(loss)


def next_batch(engine):
    """The next ``(inputs, labels)`` from the engine's data iterator (``PipelineEngine._next_batch``)."""
    return engine._next_batch()


def tied_weight_grad(engine, weight):
    """The gradient of a tied weight that its stages sum: bf16's fp32 accumulation (``_hp_grad``)
    under DeepSpeed's bf16 optimizer, else ``weight.grad``."""
    return weight._hp_grad if engine.using_bf16_optimizer else weight.grad


def pipeline_backward_pass(engine, buffer_id: int) -> None:
    """DeepSpeed's own ``B`` handler (``PipelineEngine._exec_backward_pass``): on the output stage,
    ``DeepSpeedEngine.backward(engine.loss)`` with its loss scaling, timers and epilogue."""
    _PipelineEngine._exec_backward_pass(engine, buffer_id)


@contextlib.contextmanager
def engine_backward(engine):
    """While active, DeepSpeed's module hooks treat a backward as the engine's own
    (``DeepSpeedEngine.backward`` sets ``_running_engine_backward`` around ``loss.backward()``).
    A plain flag, set past ``nn.Module.__setattr__``'s registry checks (twice a backward)."""
    object.__setattr__(engine, "_running_engine_backward", True)
    try:
        yield
    finally:
        object.__setattr__(engine, "_running_engine_backward", False)


def _backward_timers(engine):
    return [engine.timers(name) for name in (*engine.engine_timers.backward_inner_timers,
                                             *engine.engine_timers.backward_timers)]


def stop_started_backward_timers(engine) -> None:
    """Stop the backward timers that DeepSpeed's output hooks started (``engine.backward``'s
    epilogue stops them; a backward run outside it must, or the next start fails)."""
    for timer in _backward_timers(engine):
        if getattr(timer, "started_", False):
            timer.stop()


def start_stopped_backward_timers(engine) -> None:
    """Restart the backward timers before :func:`backward_epilogue` stops them again."""
    if not engine.wall_clock_breakdown():
        return
    for timer in _backward_timers(engine):
        if not getattr(timer, "started_", True):
            timer.start()


def backward_epilogue(engine) -> None:
    """What ``DeepSpeedEngine.backward`` runs once a backward's gradients exist (its all-reduce
    at a boundary, bf16's gradient hand-over, the timers)."""
    engine._backward_epilogue()


def backward_graph_tracker():
    """DeepSpeed's tracker of the autograd graphs whose loss the engine already scaled."""
    return _ds_engine._ENGINE_BACKWARD_GRAPH_TRACKER


def hp_grads_deferred(engine) -> bool:
    """Whether DeepSpeed's bf16 optimizer waits for ``update_hp_grads`` to move a backward's
    gradients into its fp32 accumulation (``immediate_grad_update`` off)."""
    return engine.using_bf16_optimizer and not engine._config.bfloat16_config.immediate_grad_update


def comms_logging_enabled() -> bool:
    """Whether DeepSpeed's communication logger (``"comms_logger": {"enabled": true}``) times
    ``deepspeed.comm`` calls."""
    return dist.comms_logger.enabled


def coalesces_p2p(device) -> bool:
    """Whether the default process group's backend for ``device`` coalesces a batch of
    point-to-point ops into one group (NCCL: ``supports_coalescing``; gloo: no, and torch's
    ``batch_isend_irecv`` then posts them one by one). A private name of torch's, not DeepSpeed's;
    kept here, with the others a backend detail needs."""
    group = torch.distributed.distributed_c10d._get_default_group()
    return bool(group._get_backend(torch.device(device)).supports_coalescing)


def configure_python_gc(engine) -> None:
    """DeepSpeed's garbage-collection settings, which ``deepspeed.initialize`` applies after building."""
    engine._configure_python_gc()


def set_layer_bounds(module, *, start: int, stop: int) -> None:
    """Give ``PipelineModule`` the range of layer indices this rank's stage builds."""
    module._set_bounds(start=start, stop=stop)


def local_layer_bounds(module) -> tuple[int, int]:
    """The ``[start, stop)`` layer indices ``PipelineModule`` built on this rank."""
    return module._local_start, module._local_stop


def layer_specs(module) -> list:
    """Every layer spec of the ``PipelineModule``, of every stage."""
    return module._layer_specs


def precompute_checkpointable_values(module) -> None:
    """Recompute ``PipelineModule``'s activation-checkpointing chunks after its interval changed."""
    module._precompute_checkpointable_values()


def is_checkpointable(module, funcs) -> bool:
    """Whether ``PipelineModule`` would checkpoint a chunk of these forward functions (a chunk of
    one stage of a rank holding several, whose bounds its precomputed list does not know)."""
    return module._is_checkpointable(funcs)
