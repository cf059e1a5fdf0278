"""GraphPipelineModule: a DeepSpeed ``PipelineModule`` whose stages form a DAG.

Every rank validates the layer graph and computes the same partition *before* the parent
constructor runs (it creates process groups, i.e. communicates), so bad input fails on every rank
with a clear message and no rank waits for another. The layers are then renumbered stage by stage
so each stage holds a contiguous index range; that keeps DeepSpeed's ``_build``, tied-weight
groups, ``stage_owner`` and per-layer checkpoint files working unchanged.

Representative signature of a stage's forward (called by :class:`GraphPipelineEngine`)::

    outputs = module((*loaded_inputs, *received_tensors))   # flat tuple, see StageSpec.in_ports
    # -> tuple aligned with StageSpec.out_ports, or the model output on the output stage
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any, Sequence

import torch
from torch import nn
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.activation_checkpointing import checkpointing
from deepspeed.runtime.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec

from ..errors import GPPError, PartitionError
from ..graph.ir import LayerGraph, TensorRef, build_layer_graph
from ..graph.placement import Placement
from ..graph.stages import Partition, StageSpec
from ..partitioning import (PARTITION_METHODS, FromPlan, GraphPipeSearch, ResolvedPartition, parse_partition_method,
                            resolve_partition)
from ..nn.dag import layer_refs, port_leaves, resolve, run_layer
from ..spec import LayerEntry, normalize_layers
from ..checkpoint import layer_model_file, layer_model_files
from . import compat
from .compat import broadcast_tied_weights, pipeline_grid
from .tensor_parallel import check_tp_layers, sharding_specs
from .flat import flatten, unflatten
from .memory import ActivationMeter, check_fits_memory, node_memory_bytes
from .rooms import resolve_fold, set_plain
from .shm import release_own_shm
from .topology import StageGrid, StageTopology

__all__ = ["GraphPipelineModule", "PARTITION_METHODS"]


class GraphPipelineModule(PipelineModule):
    """A ``PipelineModule`` over a DAG of layers, cut into a DAG of stages.

    Parameters beyond ``PipelineModule``'s:

    input_names
        Names of the graph inputs, in the order batches provide them.
    output
        The layer whose output goes to ``loss_fn`` (default: the last layer of the list).
    partition_method
        How the layers are cut into stages; :func:`~gpp_deepspeed.partitioning.resolve_partition`
        resolves it, and every rank computes or loads the same partition. The names DeepSpeed users
        write map through :data:`~gpp_deepspeed.partitioning.PARTITION_ALIASES`: ``"parameters"``
        (default) or ``"uniform"``, the branch-aware cut balanced by parameter or layer count
        (independent branches on separate stages, accepting a heaviest stage up to 10% above the
        least possible one when that makes the stage graph shallower); ``"sequential"``, the chain
        baseline (the list order cut as DeepSpeed cuts it, run as a chain that relays a tensor
        through every stage it skips); ``"type:<regex>"``, the branch-aware cut counting the layers
        whose class matches; ``"graphpipe"``, GraphPipe's search priced by ``cost_db`` (time
        proportional to parameters without one). Also: a plan (a :class:`~gpp_deepspeed.planner.Plan`
        or the path of the JSON file ``gpp plan`` wrote), whose stage count must be the pipeline's,
        whose devices per stage are the stage degrees and which runs as a chain if priced as one
        (``"pipeline": "chain"``); a ``{layer_name: stage_idx}`` mapping; a partition option
        (:class:`~gpp_deepspeed.partitioning.BranchBalanced`, ...); or a
        :class:`~gpp_deepspeed.partitioning.ResolvedPartition`.
    cost_db
        The cost database ``partition_method="graphpipe"`` plans with.
    stage_degrees
        Ranks per stage (data-parallel degree of each stage), e.g. ``[2, 1, 1]``; ``sum`` must divide
        the world size (the quotient is the number of replicas of the whole stage DAG). Each stage
        splits every micro-batch into equal row shards, one per rank, and stage edges reshard
        rows between stages of different degrees. A plan file carries its own (its stages'
        ``devices``). Default: one rank per stage.
    stages_per_rank, fold
        Several stages per pipeline rank (virtual stages, for the schedules ``"interleaved"`` and
        ``"zbv"``): ``num_stages`` stages on ``num_stages / stages_per_rank`` pipeline ranks, in
        looped placement (stage ``s`` on rank ``s mod R``), or as ``fold`` says: ``"looped"``,
        ``"v"`` (rank ``r`` holds stages ``r`` and ``2R - 1 - r``, ZB-V's) or the rank of every stage.
        Each rank builds, loads and saves its own stages' layers only. The engine's config must
        agree (``graph_pipeline.stages_per_rank`` / ``fold``).
    stage_tp
        Tensor-parallel degree of each stage, e.g. ``[2, 1, 2]``: stage ``s``'s ``stage_degrees[s]``
        ranks per replica are ``stage_tp[s]`` adjacent ranks (a TP group, which its layers
        all-reduce over: ``module.mpu().get_slice_parallel_group()``) times its data-parallel
        degree. A plan's stages may carry their own ``tp``. DeepSpeed's
        ``PipeModelDataParallelTopology(num_pp, num_mp, num_dp)`` as ``topology`` means
        ``stage_tp = [num_mp] * num_pp`` and ``stage_degrees = [num_mp] * num_pp`` (``num_dp``
        replicas). Default: 1 each.
    tp_across_nodes
        Allow a TP group to span nodes (``LOCAL_SIZE`` ranks each); refused by default.
    """

    def __init__(self, layers: Sequence[Any], *, input_names: Sequence[str] = ("input", ), output: str | None = None,
                 num_stages: int | None = None, topology=None, loss_fn=None, partition_method: Any = "parameters",
                 base_seed: int = 1234, seed_layers: bool = False, seed_fn=None, activation_checkpoint_interval: int = 0,
                 activation_checkpoint_func=checkpointing.checkpoint, checkpointable_layers=None,
                 dynamic_shape: bool = False, cost_db: Any = None, stage_degrees: Sequence[int] | None = None,
                 stages_per_rank: int = 1, fold: Any = None, stage_tp: Sequence[int] | None = None,
                 tp_across_nodes: bool = False):
        entries = normalize_layers(layers, input_names, base_seed=base_seed)
        graph = build_layer_graph(input_names, [(e.name, e.inputs) for e in entries], output=output)
        _check_buildable(entries)
        if not dist.is_initialized():
            dist.init_distributed(dist_backend=get_accelerator().communication_backend_name())
        world_size = dist.get_world_size()
        by_name = {e.name: e for e in entries}
        option = parse_partition_method(partition_method, cost_db=cost_db)
        measured = None
        if isinstance(option, GraphPipeSearch) and option.profile is not None and option.cost_db is None:
            option = _measured(option, layers, input_names, output)
            measured = option.cost_db
        num_stages = _pipe_stages(num_stages, topology, world_size)
        stage_degrees, stage_tp = _topology_tp(topology, stage_degrees, stage_tp)
        if isinstance(option, FromPlan) and option.plan.fold and fold is None and stages_per_rank == 1:
            fold = list(option.plan.fold)   # a folded plan places its stages on ranks itself
        folded = resolve_fold(fold, stages_per_rank, num_stages, world_size)
        resolved = resolve_partition(graph, option, num_stages=len(folded) if folded else num_stages,
                                     stage_degrees=stage_degrees, world_size=None if folded else world_size,
                                     param_count=lambda name: _count_params(by_name[name]),
                                     layer_type=lambda name: _type_name(by_name[name].layer))
        placement = _placement(resolved, world_size, folded, tp=stage_tp, tp_across_nodes=tp_across_nodes)
        partition = resolved.partition
        _check_fits(entries, partition, placement)
        # Several stages per rank: layers numbered rank by rank, so each rank's are contiguous
        # (DeepSpeed builds one index range per rank); one stage per rank: stage by stage.
        self._stage_order = sorted(range(partition.num_stages), key=lambda s: (placement.position(s), s))
        # Plain attributes may be set before nn.Module.__init__; the parent's __init__ needs them.
        self.graph: LayerGraph = graph
        self._output_ref = TensorRef(graph.output)
        self.partition: Partition = partition
        self._entries: list[LayerEntry] = [by_name[n] for s in self._stage_order for n in partition.stages[s].layers]
        self._list_index = {e.name: i for i, e in enumerate(entries)}   # DeepSpeed's layer_XX numbering
        # Set by the engine before each forward: how many tensors each in-port carries (-1: one
        # tensor, k: a tuple of k), learned from the layouts of the received edges.
        self.in_arity: list[int] | None = None
        self.engine_attached = False
        self.placement: Placement = placement
        self.resolved_partition: ResolvedPartition = resolved
        # partition_method="graphpipe" with a DeviceProfile: the costs timed at start-up (same on every rank)
        self.measured_costs = measured
        # The schedule a plan was priced with; the engine runs it unless its config names one.
        self.plan_schedule: str | None = resolved.schedule
        # The compute times it was ordered with (a folded plan's; () without a plan or times).
        self.plan_stage_times = resolved.stage_times
        self.plan_max_in_flight = resolved.max_in_flight   # and the caps of in-flight micro-batches (): its own
        # The first communication: every rank has passed init_distributed, so each can unlink its
        # DeepSpeed shm file now (the memory stays mapped) and nothing is left in /dev/shm.
        release_own_shm()
        # What splitting a stage's captured layers over its TP group would refuse, refused on every
        # rank now, before the grid's groups are made.
        for s in range(partition.num_stages):
            check_tp_layers([by_name[n].layer for n in partition.stages[s].layers], placement.tp[s])
        # The parent builds DeepSpeed's cartesian grid by name; ours answers the same queries per stage.
        pipeline = placement.pipeline()   # DeepSpeed's grid sees pipeline ranks, not stages
        with pipeline_grid(lambda process_group=None, topology=None: StageGrid(pipeline, topology)):
            super().__init__(layers=[e.layer for e in self._entries], topology=StageTopology(pipeline),
                             loss_fn=loss_fn, seed_layers=seed_layers, seed_fn=seed_fn, base_seed=base_seed,
                             partition_method="graph", activation_checkpoint_interval=activation_checkpoint_interval,
                             activation_checkpoint_func=activation_checkpoint_func,
                             checkpointable_layers=checkpointable_layers, dynamic_shape=dynamic_shape)
        # This rank's stages, and the local layer indices of each (the engine selects one per action).
        self.stages: tuple[int, ...] = tuple(s for s in self._stage_order if placement.position(s) == self.stage_id)
        self._local_entries = self._entries[slice(*compat.local_layer_bounds(self))]
        self._layer_refs = [layer_refs(e) for e in self._local_entries]   # parsed once, run every micro-batch
        first = [0]
        for s in self.stages:
            first.append(first[-1] + len(partition.stages[s].layers))
        self._stage_idxs = {s: range(first[i], first[i + 1]) for i, s in enumerate(self.stages)}
        self.select(self.stages[0])
        if activation_checkpoint_interval == 0 and not placement.fold and self.stage_id in resolved.recompute:
            # The plan chose recomputation for this stage (PipeDream-2BW's planner): its layers
            # run as one checkpointed chunk here, and every other stage keeps its activations.
            self.activation_checkpoint_interval = len(self._local_entries)
            compat.precompute_checkpointable_values(self)
        # What autograd holds for this stage's backward passes (the memory report's activation peak).
        # The engine sets the steps it measures (graph_pipeline.activation_meter_steps).
        self.activations = ActivationMeter(self.parameters)
        self.glue_placeholder: nn.Parameter | None = None
        if not any(p.requires_grad for p in self.parameters()):
            # A glue-only stage (an Add of skips, a concat): torch and DeepSpeed optimizers refuse
            # an empty parameter list, so the stage holds one zero parameter that no layer reads.
            # forward() adds 0 * it to an output, so it gets an exact zero gradient by autograd
            # like any parameter (DeepSpeed's bf16 optimizer needs one) and no update moves it
            # (none of SGD, Adam or weight decay moves a zero with a zero gradient). It is in no
            # layer file and not in graph_state_dict().
            self.glue_placeholder = nn.Parameter(torch.zeros(1))

    # -- partitioning and building (called by PipelineModule.__init__) --------------------------

    def _partition_layers(self, method="graph"):
        per_rank = [0] * (self.placement.pipeline().num_stages + 1)   # layer cut points per pipeline rank
        for s in range(self.partition.num_stages):
            per_rank[self.placement.position(s) + 1] += len(self.partition.stages[s].layers)
        for r in range(1, len(per_rank)):
            per_rank[r] += per_rank[r - 1]
        self.parts = per_rank
        compat.set_layer_bounds(self, start=self.parts[self.stage_id], stop=self.parts[self.stage_id + 1])

    def _build(self):
        # The parent seeds layer i with seed_fn(base_seed + i) when seed_layers is set: route that
        # to each entry's own seed (by name), whatever the user's forward-time seeding settings.
        # Inside fork_rng: the user's generators come out as they went in, so dropout masks and
        # whatever random the user does next still follow the user's own seed.
        user = (self.seed_layers, self.seed_fn)
        self.seed_layers, self.seed_fn = True, self._seed_for_build
        try:
            # Tensor parallelism (issue 29): a stage split over a TP group builds its captured layers split.
            grid = self.mpu()
            tp_group = grid.get_slice_parallel_group() if grid.get_slice_parallel_world_size() > 1 else None
            local = compat.layer_specs(self)[slice(*compat.local_layer_bounds(self))]
            with torch.random.fork_rng(devices=_rng_devices()), sharding_specs(local, tp_group):
                super()._build()
        finally:
            self.seed_layers, self.seed_fn = user

    def _seed_for_build(self, seed: int) -> None:
        # Only the generators fork_rng restores: torch.manual_seed would also queue a seed for every
        # CUDA device not yet initialised, which would land on the user's generators later.
        seed = self._entries[seed - self.base_seed].seed
        torch.random.default_generator.manual_seed(seed)
        for device in _rng_devices():
            torch.cuda.default_generators[device].manual_seed(seed)

    def _index_tied_modules(self):
        """One group per tie key: every rank, of every replica, of every stage holding a copy.

        DeepSpeed builds one group per data-parallel index, which assumes every stage has the
        same degree. The engine divides each copy's gradient by its stage's data-parallel size
        before summing over this group, so the sum is the tied weight's total gradient whatever
        the degrees. Copies outside the first stage holding the key are marked
        ``ds_pipe_replicated`` so that gradient norms count the weight once.
        """
        tied_comms = {}
        if self.num_stages == 1:
            return tied_comms
        specs = compat.layer_specs(self)
        for key in sorted({s.key for s in specs if isinstance(s, TiedLayerSpec)}):
            stages = sorted({self.stage_owner(i) for i, s in enumerate(specs)
                             if isinstance(s, TiedLayerSpec) and s.key == key})
            pipeline = self.placement.pipeline()   # stages here are pipeline ranks (several stages each under a fold)
            tps = {pipeline.tp[s] for s in stages}
            if len(tps) > 1:
                raise GPPError(f'tied layers "{key}" sit on stages {stages} of TP degrees '
                               f"{[pipeline.tp[s] for s in stages]}; tied copies need one TP degree")
            for t in range(tps.pop()):   # one group per TP rank: each holds its own slice of the weight
                ranks = sorted(r for s in stages for r in pipeline.data_group(s, t))
                group = dist.new_group(ranks=ranks)
                if self.global_rank in ranks:
                    tied_comms[key] = {"ranks": ranks, "group": group, "weight_attr": self.tied_weight_attrs[key],
                                       "module": self.tied_modules[key]}
                    if self.stage_id != stages[0]:
                        for p in self.tied_modules[key].parameters():
                            p.ds_pipe_replicated = True
        return tied_comms

    def _synchronize_tied_weights(self):
        """DeepSpeed's initial broadcast of tied weights, outside autograd (see
        :func:`~gpp_deepspeed.engine.compat.broadcast_tied_weights`)."""
        broadcast_tied_weights(self.tied_comms)

    # -- stage forward ------------------------------------------------------------------------

    @property
    def is_output_stage(self) -> bool:
        return self.stage == self.partition.stage_graph.output_stage

    def select(self, stage: int, *, frozen: bool = False) -> None:
        """Make ``stage``, one of this rank's :attr:`stages`, the one :meth:`forward` runs
        (``frozen``: it has nothing to differentiate and runs no backward; the engine says)."""
        set_plain(self, stage=stage, stage_spec=self.partition.stages[stage], frozen=frozen)

    def stage_parameters(self, stage: int) -> list[nn.Parameter]:
        """The parameters ``stage``'s layers use (tied ones included), once each: all of this
        rank's when it holds one stage."""
        if len(self.stages) == 1:
            return list(self.parameters())
        out: dict[int, nn.Parameter] = {}
        for i in self._stage_idxs[stage]:
            entry, fn = self._local_entries[i], self.forward_funcs[i]
            module = self.tied_modules[entry.tie_key] if entry.tie_key is not None else fn
            if isinstance(module, nn.Module):
                out.update((id(p), p) for p in module.parameters())
        if self.glue_placeholder is not None:
            out[id(self.glue_placeholder)] = self.glue_placeholder
        return list(out.values())

    def forward(self, inputs):
        if not self.engine_attached:
            raise GPPError("a GraphPipelineModule runs only inside GraphPipelineEngine: build the engine with "
                           "gpp_deepspeed.initialize(...), not deepspeed.initialize(...)")
        flat = (inputs, ) if torch.is_tensor(inputs) else tuple(inputs)
        arity = self.in_arity or [-1] * len(flat)
        env: dict[TensorRef, Any] = dict(zip(self.stage_spec.in_ports, unflatten(flat, arity)))
        # Per micro-batch: plain attributes go past nn.Module.__setattr__, and the meter's context
        # is entered only while it measures (see rooms.set_plain, memory.ActivationMeter).
        set_plain(self, micro_offset=self.micro_offset + 1)
        if self.activations.on:
            with self.activations.saving():
                self._run_stage(env)
        else:
            self._run_stage(env)
        if self.is_output_stage:
            return self._touch_placeholder(resolve(env, self._output_ref))
        return self._touch_placeholder(tuple(port_leaves(ref, resolve(env, ref)) for ref in self.stage_spec.out_ports))

    def _run_stage(self, env: dict) -> None:
        if self.activation_checkpoint_interval > 0:
            self._run_checkpointed(env)
        else:
            self._run(env, self._stage_idxs[self.stage])

    def _touch_placeholder(self, outputs):
        """``outputs`` (a tensor, or tuples / lists of tensors) with
        ``0 * glue_placeholder`` added to its first floating-point tensor: the values do not change
        (x + 0.0 == x) and the placeholder joins the autograd graph."""
        if self.glue_placeholder is None or self.frozen or not torch.is_grad_enabled():
            return outputs
        if torch.is_tensor(outputs):
            return outputs + 0 * self.glue_placeholder.to(outputs.dtype).sum() if outputs.is_floating_point() else outputs
        if isinstance(outputs, (tuple, list)):
            for i, value in enumerate(outputs):
                touched = self._touch_placeholder(value)
                if touched is not value:
                    rebuilt = [*outputs[:i], touched, *outputs[i + 1:]]
                    return outputs._make(rebuilt) if hasattr(outputs, "_make") else type(outputs)(rebuilt)
        return outputs

    def _run(self, env: dict, local_idxs, micro_offset: int | None = None) -> None:
        # A recomputed chunk runs during a later backward: it seeds with the forward's micro_offset.
        micro_offset = self.micro_offset if micro_offset is None else micro_offset

        entries, funcs, refs = self._local_entries, self.forward_funcs, self._layer_refs
        for i in local_idxs:
            if self.seed_layers:   # each layer seeded as the interpreter reaches it
                seed = self.base_seed * (micro_offset + 1) + i + compat.local_layer_bounds(self)[0]
                (self.seed_fn or torch.manual_seed)(seed)
            run_layer(env, entries[i], funcs[i], refs=refs[i])

    def _run_checkpointed(self, env: dict) -> None:
        """Run chunks of ``activation_checkpoint_interval`` consecutive layers under the checkpoint
        function; a chunk takes the values it reads from outside and returns those read after it."""
        num = len(self._local_entries)
        interval = self.activation_checkpoint_interval
        chunks = zip(range(0, num, interval), self.is_checkpointable_results)
        if len(self.stages) > 1:   # several stages per rank: the chunks of the selected stage's layers
            own = self._stage_idxs[self.stage]
            num = own.stop
            chunks = ((c, compat.is_checkpointable(self, self.forward_funcs[c:min(c + interval, num)]))
                      for c in range(own.start, own.stop, interval))
        for chunk, checkpointable in chunks:
            idxs = range(chunk, min(chunk + interval, num))
            if not checkpointable:
                self._run(env, idxs)
                continue
            reads, writes = self._chunk_io(idxs)
            flat_in, in_arity = flatten([resolve(env, r) for r in reads])
            out_arity: list[int] = []

            def run_chunk(*flat, _idxs=idxs, _reads=reads, _writes=writes, _in_arity=in_arity,
                          _offset=self.micro_offset):
                local = dict(zip(_reads, unflatten(flat, _in_arity)))
                self._run(local, _idxs, _offset)
                flat_out, arity = flatten([local[TensorRef(n)] for n in _writes])
                out_arity[:] = arity
                return tuple(flat_out)

            outs = self.activation_checkpoint_func(run_chunk, *flat_in)
            outs = (outs, ) if torch.is_tensor(outs) else outs
            env.update(zip((TensorRef(n) for n in writes), unflatten(tuple(outs), out_arity)))

    def _chunk_io(self, idxs) -> tuple[list[TensorRef], list[str]]:
        names = {self._local_entries[i].name for i in idxs}
        reads: list[TensorRef] = []
        for i in idxs:
            for r in map(TensorRef.parse, self._local_entries[i].inputs):
                if r.node not in names and r not in reads:
                    reads.append(r)
        later = {TensorRef.parse(r).node for j in range(idxs.stop, len(self._local_entries))
                 for r in self._local_entries[j].inputs}
        later |= {r.node for r in self.stage_spec.out_ports} | {self.graph.output}
        return reads, [self._local_entries[i].name for i in idxs if self._local_entries[i].name in later]

    # -- naming ---------------------------------------------------------------------------------

    def ckpt_layer_path(self, ckpt_dir, local_layer_idx):
        """Layer files are keyed by layer name (:mod:`gpp_deepspeed.checkpoint`), not by the
        partition-dependent index DeepSpeed uses, so checkpoints move between layouts."""
        entry = self._local_entries[local_layer_idx]
        rank_repr = self.mpu().topology().get_rank_repr(rank=self.global_rank)
        if entry.packed and self.placement.has_tp:
            # A DeepSpeed layer list under TP (the 3D drop-in): DeepSpeed's own layer_XX-model_YY
            # name, so that its loader reads our checkpoint; ours reads it by index (below).
            return os.path.join(ckpt_dir, f"layer_{self._list_index[entry.name]:02d}-{rank_repr}-model_states.pt")
        return layer_model_file(ckpt_dir, entry.name, rank_repr)

    def ckpt_layer_path_list(self, ckpt_dir, local_layer_idx):
        name = self._local_entries[local_layer_idx].name
        files = layer_model_files(ckpt_dir, name, index=self._list_index[name])
        if not files:
            raise GPPError(f'checkpoint {ckpt_dir} has no file for layer "{name}" (looked for '
                           f"{os.path.basename(layer_model_file(ckpt_dir, name))} and DeepSpeed's "
                           f"layer_{self._list_index[name]:02d}-*model_states.pt)")
        return files

    def local_layer_names(self) -> tuple[str, ...]:
        return tuple(name for s in self.stages for name in self.partition.stages[s].layers)

    def trainable_layer_names(self) -> list[str]:
        """This stage's layers that hold a parameter with ``requires_grad`` (tied ones included)."""
        names = []
        for entry, fn in zip(self._local_entries, self.forward_funcs):
            module = self.tied_modules[entry.tie_key] if entry.tie_key is not None else fn
            if isinstance(module, nn.Module) and any(p.requires_grad for p in module.parameters()):
                names.append(entry.name)
        return names

    def graph_state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's parameters and buffers named as in :class:`~gpp_deepspeed.GraphModel`."""
        out: dict[str, torch.Tensor] = {}
        for entry, fn in zip(self._local_entries, self.forward_funcs):
            key = entry.tie_key
            module = self.tied_modules[key] if key is not None else fn
            if not isinstance(module, nn.Module):
                continue
            prefix = f"tied.{key}." if key is not None else f"layers.{entry.name}."
            out.update({prefix + k: v for k, v in module.state_dict().items()})
        return out


def _check_buildable(entries: list[LayerEntry]) -> None:
    """Every layer on the meta device must have a way to get values (an initialiser or a checkpoint):
    checked on every rank, for every stage, by a dry run on meta tensors, before any communication."""
    for entry in entries:
        check = getattr(entry.layer, "check_buildable", None)
        if check is not None:
            check()


def _check_fits(entries: list[LayerEntry], partition: Partition, placement: Placement) -> None:
    """Refuse, before anything is built or communicated, stages whose parameters and gradients alone
    exceed the memory of the device (a GPU) or of the node its ranks share (CPU): counted on meta
    copies of the layers, so a model built on the meta device is checked whole on every rank."""
    pipeline = placement.pipeline()      # what each rank holds: its stages, or its one stage
    stage_bytes = [0] * pipeline.num_stages
    ties: set[tuple[int, str]] = set()
    for entry in entries:
        stage = placement.position(partition.stage_of[entry.name])
        if entry.tie_key is not None:
            if (stage, entry.tie_key) in ties:
                continue
            ties.add((stage, entry.tie_key))
        stage_bytes[stage] += _layer_bytes(entry)
    rank_stage = [pipeline.locate(r).stage for r in range(placement.world_size)]
    if torch.cuda.is_available() and get_accelerator().device_name() == "cuda":
        check_fits_memory(stage_bytes, rank_stage, local_size=1, what="parameters and gradients",
                          node_bytes=torch.cuda.get_device_properties(0).total_memory)
    else:
        check_fits_memory(stage_bytes, rank_stage, local_size=int(os.environ.get("LOCAL_SIZE", placement.world_size)),
                          node_bytes=node_memory_bytes(), what="parameters and gradients")


def _layer_bytes(entry: LayerEntry) -> int:
    """Bytes of a layer's parameters and buffers plus its trainable parameters' gradients."""
    layer = entry.layer
    if isinstance(layer, LayerSpec):
        with torch.device("meta"):
            layer = layer.build()
    if not isinstance(layer, nn.Module):
        return 0
    tensors = {id(t): t for t in (*layer.parameters(), *layer.buffers())}.values()
    return sum(t.numel() * t.element_size() * (2 if t.requires_grad and isinstance(t, nn.Parameter) else 1)
               for t in tensors)


def _measured(option: GraphPipeSearch, layers, input_names, output) -> GraphPipeSearch:
    """``partition_method="graphpipe"`` with a :class:`~gpp_deepspeed.partitioning.DeviceProfile`:
    the layers timed on every rank's device now, agreed across ranks, priced at the profile's
    micro-batch (default: the largest timed)."""
    from ..profiler import profile_on_ranks

    profile = option.profile
    with torch.random.fork_rng(devices=_rng_devices()):   # building and timing leave the user's RNG alone
        db = profile_on_ranks(layers, input_names=input_names, output=output, profile=profile,
                              device=get_accelerator().current_device_name())
    return replace(option, cost_db=db, profile=None, micro_batch=profile.micro_batch or profile.micro_batches[-1])


def _rng_devices() -> list[int]:
    """The CUDA device whose generator building layers may use: this process's current one, if CUDA
    is initialised (forking every visible device's generator would initialise them all)."""
    return [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []


def _pipe_stages(num_stages: int | None, topology, world_size: int) -> int | None:
    """The pipeline's stage count: DeepSpeed's ``topology`` (its ``pipe`` axis) when given, checked
    against the world size before any communication, else ``num_stages``."""
    if topology is None:
        return num_stages
    if set(topology.get_axis_names()) - {"pipe", "data", "model"}:
        raise PartitionError(f"the topology has axes {topology.get_axis_names()}; a GraphPipelineModule supports "
                             "'pipe', 'data' and 'model' (DeepSpeed's PipeModelDataParallelTopology)")
    if topology.world_size() != world_size:
        raise PartitionError(f"the topology has {topology.world_size()} ranks but the world size is {world_size}")
    return topology.get_dim("pipe")


def _topology_tp(topology, stage_degrees, stage_tp):
    """``(stage_degrees, stage_tp)`` with DeepSpeed's ``model`` axis, if ``topology`` has one: that
    many TP ranks per stage, each stage on one TP group per replica (``num_dp`` replicas)."""
    if topology is None or "model" not in topology.get_axis_names():
        return stage_degrees, stage_tp
    mp, pp = topology.get_dim("model"), topology.get_dim("pipe")
    if stage_tp is not None and list(stage_tp) != [mp] * pp:
        raise PartitionError(f"stage_tp {list(stage_tp)} contradicts the topology's model axis ({mp} on each of "
                             f"{pp} stages); give one or the other")
    if stage_degrees is not None and list(stage_degrees) != [mp] * pp:
        raise PartitionError(f"stage_degrees {list(stage_degrees)} contradicts the topology (pipe {pp} x model "
                             f"{mp}: {mp} ranks per stage and replica); give one or the other")
    return [mp] * pp, [mp] * pp


def _placement(resolved: ResolvedPartition, world_size: int, fold: tuple[int, ...] = (), *, tp=None,
               tp_across_nodes: bool = False) -> Placement:
    """Which ranks run which stage: ``resolved.stage_degrees`` ranks per stage in every copy of the
    stage DAG (stages sharing ranks as ``fold`` says), ``tp`` (else a plan's ``stage_tp``, else 1) of
    them per TP group, stage blocks packed into nodes of ``LOCAL_SIZE`` ranks."""
    planned = getattr(resolved, "stage_tp", None)
    if tp is not None and planned is not None and tuple(tp) != tuple(planned):
        raise PartitionError(f"stage_tp {list(tp)} contradicts the plan's TP degrees {list(planned)}")
    tp = tp if tp is not None else planned
    node = int(os.environ.get("LOCAL_SIZE", world_size))
    # A topology-aware plan was mapped to devices assuming stage blocks in stage order
    # (planner.topology.rank_order); the launcher permutes ranks, so keep that order.
    placement = Placement.build(resolved.stage_degrees, world_size=world_size, fold=fold, tp=tp, tp_across_nodes=True,
                                local_size=world_size if resolved.keep_stage_order else node)
    if not tp_across_nodes:
        placement.check_tp_in_nodes(node)
    return placement


def _count_params(entry: LayerEntry) -> int:
    layer = entry.layer
    if isinstance(layer, LayerSpec):
        # Built on the meta device: the count costs no memory and no initialisation.
        with torch.device("meta"):
            layer = layer.build()
    if isinstance(layer, nn.Module):
        return sum(p.numel() for p in layer.parameters() if p.requires_grad)
    return 0


def _type_name(layer: Any) -> str:
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if isinstance(layer, nn.Module):
        return type(layer).__name__
    return getattr(layer, "__name__", type(layer).__name__)
