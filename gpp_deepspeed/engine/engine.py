"""GraphPipelineEngine: DeepSpeed's PipelineEngine running a DAG of stages.

It subclasses ``PipelineEngine`` and extends its instruction dispatch table (the pattern of
DeepSpeed's own ``dualpipev.py``); ZeRO-1, bf16, gradient clipping, data parallelism, loss
aggregation and checkpoints are DeepSpeed's. What changes:

* "first stage" means "reads graph inputs from the batch" (there may be several), and "last
  stage" means the output stage, which reads labels and computes the loss;
* every batch runs a :class:`~gpp_deepspeed.schedule.Program`, this stage's action list of it, from
  the schedule's :class:`~gpp_deepspeed.schedule.ProgramFactory` (validated once per shape: deadlock
  under NCCL's rendezvous semantics, buffer reuse, release points); the program decides the
  buffer slot of every micro-batch, when buffers are freed and which transfers are posted
  together. The engine only executes it, one instruction per action, a release in the dispatch of
  the action before it (:mod:`.instructions`).

The engine owns one object per job (``docs/architecture.md``, "The engine's rooms"):

``rooms``
    :class:`~.rooms.RankStages`, this rank's stages (one, or several under a fold), each with its
    buffers (:class:`~.buffers.StageBuffers`, ``pipe_buffers`` points at the entered stage's) and
    its edges (:class:`~.transfers.StageTransfers`); every transfer action and hand-over;
``stage_backward``
    :class:`~.backward.StageBackward`, ``B``, ``I``, ``W`` and the parameter-gradient bracket;
``zero``
    :class:`~.zero.StageZero`, what ZeRO-2/3 add to a stage;
``collector``
    :class:`~.collector.StepCollector`, the cyclic collections between batches that
    ``gc_interval`` asks for (``gc_freeze`` is applied by ``initialize``);
``_async``
    :class:`~.asynchronous.AsyncPipeline`, an asynchronous schedule's batch count and weight
    versions (:mod:`.weights`); :meth:`flush` drains it.

The ``LOAD`` handler and the data loader are :mod:`.data`.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

import torch
from deepspeed import comm as dist
from deepspeed.runtime.pipe import schedule as ds
from deepspeed.runtime.pipe.engine import (PIPE_RECV_GRAD_TIMER, PIPE_RECV_INPUT_TIMER, PIPE_SEND_GRAD_TIMER,
                                            PIPE_SEND_OUTPUT_TIMER, PipelineEngine)
from deepspeed.utils import logger

from ..checkpoint import latest_tag
from ..config import GraphPipelineConfig, with_plan_schedule
from ..errors import GPPConfigError
from ..graph.stages import mark_gradient_flow
from ..schedule import KINDS, Program, ProgramFactory, get_schedule
from ..schedule.asynchronous import steady_batch_idx
from ..schedule.greedy import Fold, stage_duration
from ..schedule.ir import Action, ActionKind as K, Buffer
from .flat import flatten
from . import asynchronous as _async
from . import compat
from .compat import count_each_stage_once
from . import data, elastic, portable
from .collector import StepCollector
from .backward import (StageBackward, check_split_backward_supported, reentrant_checkpointing,
                       use_split_backward_recompute)
from .instructions import (BackwardInputPass, BackwardWeightPass, GraphPipeSchedule, HandOver, Release, Transfers,
                           WaitReceives, WaitSends)
from .watchdog import start_watchdog
from .memory import MemoryReport, memory_report
from .module import GraphPipelineModule
from .p2p import EdgeTransport
from .reshard import warm_up_pairs
from .rooms import RankStages, check_folding, set_plain
from .zero import StageZero, check_zero_supported

__all__ = ["GraphPipelineEngine"]

_WAITING = frozenset(k for k, spec in KINDS.items() if spec.waits)

# DeepSpeed's pipe timer of each transfer kind (wall_clock_breakdown): a layout shares its data's.
_TIMERS = {K.SEND_F: PIPE_SEND_OUTPUT_TIMER, K.RECV_F: PIPE_RECV_INPUT_TIMER, K.SEND_B: PIPE_SEND_GRAD_TIMER,
           K.RECV_B: PIPE_RECV_GRAD_TIMER, K.SEND_L: PIPE_SEND_OUTPUT_TIMER, K.RECV_L: PIPE_RECV_INPUT_TIMER}


class GraphPipelineEngine(PipelineEngine):
    """Trains a :class:`GraphPipelineModule`; built by :func:`gpp_deepspeed.initialize`."""

    def __init__(self, *args, gpp_config: GraphPipelineConfig | None = None, **kwargs):
        # The parent's __init__ warms up p2p along stage ids 0..S-1 with is_first/last_stage() in
        # their linear sense; the DAG meaning applies once construction is over.
        self._dag_ready = False
        # The config's schedule wins over the one a loaded plan was priced with (see config.py).
        gpp_config = with_plan_schedule(gpp_config or GraphPipelineConfig(),
                                        getattr(kwargs.get("model"), "plan_schedule", None))
        self.schedule_spec = get_schedule(gpp_config.schedule)
        config_class = kwargs.get("config_class")
        check_zero_supported(config_class, self.schedule_spec)
        check_split_backward_supported(self.schedule_spec, kwargs.get("model"),
                                       config_class.pipeline if config_class is not None else None)
        check_folding(self.schedule_spec, kwargs.get("model"), gpp_config, config_class)
        super().__init__(*args, **kwargs)
        if not isinstance(self.module, GraphPipelineModule):
            raise GPPConfigError("GraphPipelineEngine needs a GraphPipelineModule")
        # pipe_partitioned / grad_partitioned (on by default with TP): their documented equivalent
        # runs (transfers.py: one message per row shard, broadcast in the TP group), so the parent's
        # forward and backward must not split the first tensor themselves.
        self.tp_partitioned = (self.is_pipe_partitioned, self.is_grad_partitioned)
        self.is_pipe_partitioned = self.is_grad_partitioned = False
        self.gpp_config = gpp_config
        use_split_backward_recompute(self)
        self.module.partition = mark_gradient_flow(self.module.partition, self._trainable_layers())
        self.stage_graph = self.module.partition.stage_graph
        self._layouts_sent = False   # a program has sent every edge's layout (see program())
        self.placement = self.module.placement
        # The rooms the engine owns: this rank's stages (buffers, transfers), its backward, ZeRO-2/3's part.
        self.rooms = RankStages(self, EdgeTransport(self.grid, self.device, stage=self.module.stages[0],
                                                    timeout_s=self.gpp_config.p2p_timeout_s))
        self.stage_backward = StageBackward(self)
        self.zero = StageZero(self)
        self.collector = StepCollector(self, self.gpp_config.gc_interval)
        count_each_stage_once(self.optimizer, is_stage_leader=self.grid.is_shard_leader(),
                              group=self.grid.get_model_parallel_group(), tp_rank=self.grid.tp_idx)
        self._programs = ProgramFactory(self.stage_graph, schedule=self.schedule_spec.name,
                                        validate=self.gpp_config.validate_schedule,
                                        fold=Fold(self.placement.fold) if self.placement.fold else None,
                                        early=self.gpp_config.early_receives, duration=self._stage_duration(),
                                        max_in_flight=self.gpp_config.max_in_flight or self.module.plan_max_in_flight
                                        or None)
        self.last_timeline: list[tuple[Action, float, float]] = []   # this stage's last batch, timed
        self._trace_events: list[dict] = []
        self._trace_t0 = time.perf_counter()
        self.module.engine_attached = True
        self._dag_ready = True
        self.watchdog = self._start_watchdog()
        elastic.check_elastic_launch(self.global_rank)
        # Every pair of ranks that exchanges tensors talks once now, in one order on all ranks, so
        # NCCL creates no communicator in the middle of a schedule.
        self.rooms.transport.warm_up(warm_up_pairs(self.placement, self.stage_graph, replica=self.grid.replica_id))
        self._async = None
        if self.schedule_spec.asynchronous:
            _async.check_async_options(self)
            self._async = _async.AsyncPipeline(self)
        if self.training_data:
            data.place_data_iter(self)
        if not self.schedule_spec.asynchronous:
            # The training programs of the configured micro-batches are made now, as torch makes its
            # schedules at construction: the first batch's (it sends every edge's layout) and the
            # steady one. No step pays for lowering (a folded schedule's takes seconds on a loaded
            # host) and what a program refuses is refused here, on every rank alike.
            for layouts in {True, bool(self.dynamic_shape)}:
                self._programs.program(self.micro_batches, train=True, layouts=layouts)
        self.module.activations.limit = self._metered_steps()
        if self.gpp_config.print_stage_graph and self.global_rank == 0:
            print(self.module.partition.describe(), flush=True)
        self._print_memory("at initialize (gradients: to be allocated by the first backward)")

    def _metered_steps(self) -> int | None:
        """The first steps whose activations the memory report measures (``None``: every step):
        ``graph_pipeline.activation_meter_steps``, where ``"until_steady"`` is up to the first
        step of the steady program (an asynchronous schedule's batches before it fill the
        pipeline: :func:`~gpp_deepspeed.schedule.asynchronous.steady_batch_idx`)."""
        steps = self.gpp_config.activation_meter_steps
        if steps == "every_step" or steps == "until_steady" and self.dynamic_shape:
            return None
        if steps != "until_steady":
            return steps
        return steady_batch_idx(self.stage_graph, self.micro_batches) + 1 if self._async is not None else 1

    def _trainable_layers(self) -> set[str]:
        """Every stage's layers with trainable parameters, gathered over the pipeline, so that all
        ranks derive the same gradient flow (frozen towers exchange no gradients)."""
        per_stage = [None] * len(self.grid.pp_group)  # one entry per rank of this replica (per-stage degrees)
        torch.distributed.all_gather_object(per_stage, self.module.trainable_layer_names(),
                                            group=self.grid.get_pipe_parallel_group())
        return {name for names in per_stage for name in names}

    def _broadcast_model(self):
        """DeepSpeed's broadcast of the initial weights over data-parallel replicas, made to accept
        0-dim parameters (CLIP's ``logit_scale``): DeepSpeed 0.19.8 sends each parameter as
        ``p.data.view(torch.uint8)``, which torch refuses for a 0-dim tensor. Each one is viewed as
        one element during the broadcast (same storage, so the received value lands in it)."""
        scalars = [p for p in self.module.parameters() if p.dim() == 0]
        for p in scalars:
            p.data = p.data.view(1)
        try:
            super()._broadcast_model()
        finally:
            for p in scalars:
                p.data = p.data.view(())

    def _build_data_iter(self, dataset):
        # DeepSpeed's pipeline loader, sharded over replicas of the stage DAG (see data.py).
        self.set_dataloader(data.stage_loader(self, dataset))

    # -- checkpoints (portable across layouts: see portable.py) ------------------------------------

    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True, exclude_frozen_parameters=False):
        self.zero.refuse_checkpoint("save_checkpoint")
        self.flush()  # an asynchronous pipeline's in-flight updates belong to the saved weights
        tag = f"global_step{self.global_steps}" if tag is None else str(tag)   # DeepSpeed's default tag

        def ds_save(into: str, latest: bool):
            out = super(GraphPipelineEngine, self).save_checkpoint(
                save_dir, tag=into, client_state=client_state, save_latest=latest,
                exclude_frozen_parameters=exclude_frozen_parameters)
            if self._async is not None:
                _async.save_state(self, os.path.join(save_dir, into))
            return out

        with self._watched():
            return portable.save_checkpoint(self, save_dir, tag, save_latest=save_latest, ds_save=ds_save)

    def load_checkpoint(self, load_dir, tag=None, **kwargs):
        """DeepSpeed's ``load_checkpoint``; a checkpoint saved under another layout (partition,
        stage count, data-parallel degree, or a ``GraphModel``) loads layer by layer by name."""
        self.zero.refuse_checkpoint("load_checkpoint")
        self.flush()
        path, client_state = portable.load_checkpoint(self, load_dir, tag, ds_load=super().load_checkpoint, **kwargs)
        tag = tag if tag is not None else latest_tag(load_dir)
        if self._async is not None and tag is not None:
            _async.load_state(self, os.path.join(load_dir, str(tag)))
        return path, client_state

    # -- roles ------------------------------------------------------------------------------------

    # While the parent's __init__ runs, both are true: that skips its p2p warm-up along stage ids
    # 0..S-1 (a chain, which neither the stage DAG nor per-stage degrees are) and hands the data
    # loader, if any, to every stage.
    def is_first_stage(self):
        """True if this stage reads graph inputs from the batch (between schedules: one of this rank's)."""
        return self.rooms.is_first() if self._dag_ready else True

    def is_last_stage(self):
        """True if this is the output stage, labels and loss (between schedules: this rank holds it)."""
        return self.rooms.is_last() if self._dag_ready else True

    def _loss_stage_global_rank(self):
        return self.grid.stage_to_global(self.placement.position(self.stage_graph.output_stage))

    def _aggregate_total_loss(self):
        """The batch's mean loss, on every rank: averaged over the output stage's data-parallel
        group, then broadcast over this replica from the output stage's first rank.

        DeepSpeed's version broadcasts from every output-stage rank as its own source, which
        needs exactly one output rank per pipeline group.
        """
        if self._async is not None and self._async.counts_batches:
            # Updates are UPDATE actions inside the pipeline, not DeepSpeed's STEP: count the batch
            # where STEP would have, before train_batch reads global_steps for its log line.
            self.global_steps += 1
            self.global_samples += self.train_batch_size()
        losses = None
        if self.is_last_stage():
            loss = compat.scale_loss_by_gas(self, self.total_loss).detach()
            agg = loss.clone()
            if self.is_data_parallel:
                dist.all_reduce(agg, group=self.grid.get_data_parallel_group())
                agg /= self.dp_world_size
            losses = [loss, agg]
        losses = self._bcast_pipe_scalar(losses, num=2)
        self.dp_group_loss = losses[0].clone()
        return losses[1].clone()

    def _bcast_pipe_scalar(self, data, src_rank=None, dtype=torch.float32, *, num: int = 1):
        """``num`` loss values of the output stage's first rank (``data``: a tensor, or a list of
        ``num`` scalars, there; ignored elsewhere), on every rank of this replica, as float32 as
        DeepSpeed returns them, or as float64 when the model computed them in float64 (the values
        travel in float64, which holds every loss dtype exactly, with a flag for that)."""
        src = self._loss_stage_global_rank() if src_rank is None else src_rank
        shared = torch.zeros(num + 1, dtype=torch.float64, device=self.device)
        if self.global_rank == src:
            values = torch.stack([torch.as_tensor(v).detach().reshape(()) for v in (
                data if isinstance(data, (list, tuple)) else [data.reshape(-1)[0]])])
            shared[:num] = values.double()
            shared[num] = float(values.dtype == torch.float64)
        if self.is_pipe_parallel:
            dist.broadcast(shared, src=src, group=self.grid.get_pipe_parallel_group())
        out = shared[0] if num == 1 else shared[:num]
        return out.to(torch.float64 if shared[num] else dtype)

    def _exec_reduce_tied_grads(self):
        """Sum each tied weight's gradient over the stages holding a copy, each copy first divided
        by its stage's data-parallel size: the data-parallel all-reduce that follows averages equal
        values, so every copy ends with the total gradient whatever the stage degrees. Under ZeRO-2
        the gradients are already reduced and partitioned (:mod:`.zero`)."""
        if self.zero.partitions_gradients:
            self.zero.reduce_tied()
            return
        for weight, group in self.module.get_tied_weights_and_groups():
            grad = compat.tied_weight_grad(self, weight)
            if grad is not None:
                grad.div_(self.dp_world_size)
                dist.all_reduce(grad, group=group)

    # -- schedules ----------------------------------------------------------------------------------

    def program(self, micro_batches: int, *, train: bool, flush: bool = False) -> Program:
        """The program of the next batch, of evaluation or of an asynchronous pipeline's flush, from
        the schedule's :class:`~gpp_deepspeed.schedule.ProgramFactory` (made and validated once per
        shape). A synchronous batch sends every activation's layout when the next batch needs them:
        always under ``dynamic_shape``, else until one batch has sent them (every batch carries
        activations on every stage edge), the same decision on every rank."""
        program = self._programs.program(micro_batches, train=train, flush=flush,
                                         batch_idx=self._async.batches if self._async is not None else None,
                                         layouts=self.dynamic_shape or not self._layouts_sent)
        if self.global_rank == 0:
            logger.debug("graph pipeline program:\n%s", program)
        return program

    def _graph_pipe_schedule(self, micro_batches: int, train: bool, *, flush: bool = False) -> GraphPipeSchedule:
        program = self.program(micro_batches, train=train, flush=flush)
        if self._async is not None and train:
            self._async.runs(program)
        self._layouts_sent |= program.layouts
        self.last_timeline = []
        schedule = GraphPipeSchedule(program.actions[self.stage_id], micro_batches=micro_batches,
                                     stages=self.num_stages, stage_id=self.stage_id, slots=program.slots,
                                     record=self.last_timeline, enter=self.rooms.enter)
        self.rooms.reserve(schedule.num_pipe_buffers())
        return schedule

    # -- what the last batch did ------------------------------------------------------------------

    def idle_fraction(self) -> float:
        """Share of the last batch's wall time this stage spent waiting: on receives and for its
        sends to complete (the pipeline bubble as this rank saw it)."""
        spans = self.last_timeline
        if not spans:
            return 0.0
        wall = spans[-1][2] - spans[0][1]
        waiting = sum(end - start for a, start, end in spans if a.kind in _WAITING)
        return waiting / wall if wall > 0 else 0.0

    def _stage_duration(self):
        """The compute times the programs are made for: ``graph_pipeline.stage_times``, else the
        plan's, else None (unit times)."""
        times = self.gpp_config.stage_times or self.module.plan_stage_times
        if not times:
            return None
        return stage_duration(times, self.stage_graph.num_stages)

    def train_batch(self, data_iter=None):
        if self._async is not None:
            self._async.in_batch = True
        with self._watched():
            loss = super().train_batch(data_iter)
        self.module.activations.end_step()
        if self._async is not None:
            self._async.in_batch = False
            self._async.batches += 1
        self.collector.after_step()
        if self.gpp_config.trace_dir is not None:
            self._trace(self.gpp_config.trace_dir)
        if self.global_steps == 1:
            self._print_memory("after step 1")
        every = self.steps_per_print()
        if self.gpp_config.print_idle_fractions and every and self.global_steps % every == 0:
            idle = [None] * len(self.grid.pp_group)  # every rank of this replica, one entry each
            torch.distributed.all_gather_object(idle, (self.stage_id, self.grid.stage_idx, self.idle_fraction()),
                                                group=self.grid.get_pipe_parallel_group())
            if self.global_rank == 0:
                shown = " ".join(f"{s}:{f:.0%}" for s, i, f in sorted(idle) if i == 0)
                print(f"steps: {self.global_steps} graph pipeline idle per stage: {shown}", flush=True)
        return loss

    def memory_report(self) -> MemoryReport:
        """Every rank's memory for its stage (:mod:`.memory`); collective: every rank calls it."""
        return memory_report(self)

    def _print_memory(self, when: str) -> None:
        if self.gpp_config.print_memory:
            report = memory_report(self)
            if self.global_rank == 0:
                print(report.describe(when), flush=True)

    def _watched(self):
        return self.watchdog.watching() if self.watchdog is not None else contextlib.nullcontext()

    def _start_watchdog(self):
        """This process's watchdog, watching the ranks this one exchanges data with."""
        if not self.gpp_config.watchdog:
            return None
        topo = self.module.topology()

        def describe(rank: int) -> str:
            coord = topo.get_coord(rank)
            stages = self.placement.stages_of(coord.pipe)   # several under a fold
            what = (f"stage {stages[0]}" if len(stages) == 1 else
                    f"stages {', '.join(map(str, stages))} (pipeline rank {coord.pipe})")
            return f"{what} of pipeline replica {coord.data}" + (f", TP rank {coord.model}" if hasattr(coord, "model") else "")

        return start_watchdog(rank=self.global_rank,
                              peers=list(dict.fromkeys([*self.grid.pp_group, *self.grid.dp_group, *self.grid.slice_group])),
                              describe=describe, heartbeat_s=self.gpp_config.heartbeat_s,
                              timeout_s=self.gpp_config.watchdog_timeout_s)

    def _trace(self, folder: str) -> None:
        """Add the last batch to this rank's Chrome trace and rewrite the file."""
        if self.global_steps > self.gpp_config.trace_steps:
            return
        for action, start, end in self.last_timeline:
            self._trace_events.append({"name": str(action), "ph": "X", "pid": self.global_rank, "tid": self.stage_id,
                                       "ts": (start - self._trace_t0) * 1e6, "dur": (end - start) * 1e6,
                                       "args": {"step": self.global_steps}})
        path = Path(folder) / f"rank{self.global_rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"traceEvents": self._trace_events, "displayTimeUnit": "ms"}))

    def _train_schedule(self):
        return self._graph_pipe_schedule(self.micro_batches, True)

    def flush(self) -> None:
        """Drain an asynchronous pipeline: run the backwards and updates of every micro-batch still
        in flight, so the weights are final. Called before ``eval_batch`` and ``save_checkpoint``;
        a no-op for the synchronous schedules and for an empty pipeline."""
        if self._async is None or self._async.batches == 0:
            return
        self.module.train()
        self._async.in_batch = True
        self._exec_schedule(self._graph_pipe_schedule(self._async.micro_batches, True, flush=True))
        self._async.in_batch = False
        self._async.batches = 0
        self._async.versions.reset()

    def weight_version_memory(self) -> dict | None:
        """For an asynchronous schedule, this stage's weight versions: the most stashed at once so
        far, the bytes of one, and their peak bytes (besides the optimizer's live weights)."""
        if self._async is None:
            return None
        versions = self._async.versions
        one = versions.version_bytes()
        return {"peak_versions": versions.peak_versions, "version_bytes": one,
                "peak_bytes": versions.peak_versions * one}

    def eval_batch(self, data_iter, *args, **kwargs):
        # One definition: an asynchronous pipeline drains first, and the watchdog covers both.
        with self._watched():
            self.flush()
            return super().eval_batch(data_iter, *args, **kwargs)

    def _inference_schedule(self, micro_batches):
        return self._graph_pipe_schedule(micro_batches, False)

    def reset_activation_shape(self):
        super().reset_activation_shape()
        self.rooms.transport.reset_layouts()
        self._layouts_sent = False

    # -- compute ----------------------------------------------------------------------------------

    def _exec_forward_pass(self, buffer_id):
        buffers = self.pipe_buffers
        loaded = buffers[Buffer.LOADED, buffer_id] or {}
        received = buffers[Buffer.RECEIVED, buffer_id] or {}
        values = [loaded[ref.node] if not ref.path and ref.node in loaded else received[ref]
                  for ref in self.spec.in_ports]
        flat, arity = flatten(values)
        set_plain(self.module, in_arity=arity)   # every forward: past nn.Module.__setattr__'s checks
        buffers[Buffer.INPUTS, buffer_id] = tuple(flat)
        versions = (self._async.versions.on_current(buffer_id) if self._async is not None and torch.is_grad_enabled()
                    else contextlib.nullcontext())
        with versions, self.zero.forward():
            super()._exec_forward_pass(buffer_id)
        if self.is_last_stage() and torch.is_grad_enabled():
            buffers[Buffer.LOSS, buffer_id] = self.loss

    def _reentrant_activation_checkpointing(self):
        # DeepSpeed asks this before recomputing (see backward.reentrant_checkpointing).
        return reentrant_checkpointing(self.module)

    def clip_fp32_gradients(self):
        """Clip by the global gradient norm over every stage of the pipeline.

        DeepSpeed's ``clip_grad_norm_`` only counts gradients on model-parallel rank 0, which under
        pipeline parallelism is stage 0 alone, so ZeRO-0 clipping (on by default, 1.0) saw a fraction
        of the norm. Here each stage adds its squared norm (tied copies counted once) and the sum is
        all-reduced over the pipeline, as ``torch.nn.utils.clip_grad_norm_`` would compute it on one
        device.
        """
        params = [p for p in self.module.parameters() if p.grad is not None]
        local = torch.zeros(1, dtype=torch.float32, device=self.device)
        for p in params:
            # Under TP a parameter not sliced over the TP group is counted on its TP rank 0 only.
            if not getattr(p, "ds_pipe_replicated", False) and (
                    self.grid.tp_idx == 0 or compat.is_model_parallel_parameter(p)):
                local += p.grad.detach().float().pow(2).sum()
        if not self.grid.is_shard_leader():
            local.zero_()  # the stage's row shards hold the same all-reduced gradients: count them once
        dist.all_reduce(local, group=self.grid.get_model_parallel_group())
        clip_coef = self.gradient_clipping() / (local[0].sqrt() + 1e-6)  # 0-dim: scales 0-dim grads too
        if clip_coef.item() < 1.0:
            for p in params:
                p.grad.detach().mul_(clip_coef.to(p.grad.dtype))

    # -- ZeRO (zero.py) ----------------------------------------------------------------------------

    def zero_optimization_stage(self):
        return compat.pipeline_assert_stage(super().zero_optimization_stage())

    def _exec_reduce_grads(self):
        if not self.zero.skips_reduce_grads():
            super()._exec_reduce_grads()

    def gathered_parameters(self):
        """This stage's parameters whole on every rank of the stage (:meth:`.zero.StageZero.gathered_parameters`)."""
        return self.zero.gathered_parameters()

    # -- the dispatch table ---------------------------------------------------------------------------

    def _exec_transfers(self, ops):
        """One transfer action (:meth:`.transfers.StageTransfers.run`), timed under each of its
        kinds' DeepSpeed pipe timers when ``wall_clock_breakdown`` is on."""
        timers = [self.timers(name) for name in dict.fromkeys(_TIMERS[kind] for kind, *_ in ops)
                  ] if self.wall_clock_breakdown() else []
        for timer in timers:
            timer.start()
        try:
            self.rooms.run(ops)
        finally:
            for timer in timers:
                timer.stop()

    def _exec_schedule(self, pipe_schedule):
        """DeepSpeed's loop over a schedule, for a :class:`GraphPipeSchedule` its compiled steps
        (:meth:`GraphPipeSchedule.run`: handlers called directly, releases with the action before;
        every room's buffers were reserved when the schedule was made)."""
        if not isinstance(pipe_schedule, GraphPipeSchedule):
            return super()._exec_schedule(pipe_schedule)
        self.fwd_outputs = []
        pipe_schedule.run(self)

    _INSTRUCTION_MAP = {
        **PipelineEngine._INSTRUCTION_MAP,
        ds.LoadMicroBatch: data.load_micro_batch,
        ds.ReduceTiedGrads: _exec_reduce_tied_grads,
        ds.ReduceGrads: _exec_reduce_grads,
        ds.ForwardPass: _exec_forward_pass,
        ds.BackwardPass: lambda engine, buffer_id: engine.stage_backward.full(buffer_id),
        BackwardInputPass: lambda engine, buffer_id: engine.stage_backward.input(buffer_id),
        BackwardWeightPass: lambda engine, buffer_id: engine.stage_backward.weight(buffer_id),
        Transfers: _exec_transfers,
        WaitSends: lambda engine: engine.rooms.transport.wait_sends(),
        WaitReceives: lambda engine, **wait: engine.rooms.complete(**wait),
        HandOver: lambda engine, **hand: engine.rooms.hand_over(**hand),
        # A release frees what the schedule's table says its kind frees.
        Release: lambda engine, buffer_id, kind: engine.pipe_buffers.free(kind.spec.frees, buffer_id),
        _async.StashWeights: _async.exec_stash,
        _async.PredictWeights: _async.exec_predict,
        _async.PredictInPlace: _async.exec_predict_inplace,
        _async.RestoreWeights: _async.exec_restore,
        _async.RetireVersion: _async.exec_retire,
        _async.UpdateWeights: _async.exec_update,
    }
