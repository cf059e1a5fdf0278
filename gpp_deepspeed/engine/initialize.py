"""``gpp_deepspeed.initialize``: ``deepspeed.initialize`` that builds a GraphPipelineEngine.

``deepspeed.initialize`` hard-codes its pipeline engine class (``PipelineEngine``, or DualPipeV's),
so this function mirrors its pipeline branch with :class:`GraphPipelineEngine`, after validating
the ``"graph_pipeline"`` config section on every rank. DeepSpeed's ``DualPipeVModule`` is converted
first (:mod:`.dualpipev`: its stages folded in a V under ``"schedule": "dualpipev"``). Any other
model goes to ``deepspeed.initialize`` unchanged.
"""

from __future__ import annotations

from typing import Any

import deepspeed
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime import zero
from deepspeed.constants import TORCH_DISTRIBUTED_DEFAULT_PORT

from ..config import CONFIG_KEY, load_config, parse_graph_pipeline_config, with_plan_schedule
from .collector import check_gc_config, freeze_startup_heap
from .compat import configure_python_gc
from .dualpipev import convert_dualpipev, is_dualpipev_module
from .engine import GraphPipelineEngine
from .module import GraphPipelineModule
from .shm import release_own_shm
from .topology import check_tp_composes, stage_batch_config
from ..schedule import get_schedule
from ..errors import GPPConfigError
from ..spec import check_captured_rows

__all__ = ["initialize"]


def _load_config(args, config, config_params) -> dict[str, Any]:
    if config is None:
        config = config_params
    from_args = getattr(args, "deepspeed_config", None)
    if from_args is not None:
        if config is not None:
            raise GPPConfigError("a DeepSpeed config was given both as --deepspeed_config and as config=...")
        config = from_args
    if config is None:
        raise GPPConfigError("DeepSpeed needs a config: pass config=<path or dict> or --deepspeed_config")
    return load_config(config)


def _rows_per_stage(config: dict[str, Any], placement) -> list[int] | None:
    """Rows a rank of each stage processes per micro-batch: the pipeline micro-batch over the
    stage's degree (None when the config gives no micro-batch size)."""
    b = config.get("train_micro_batch_size_per_gpu")
    tb, m = config.get("train_batch_size"), config.get("gradient_accumulation_steps")
    if b is None and tb is not None and m is not None:
        b = tb // (m * placement.replicas)
    return None if b is None else [b // n for n in placement.dp]


_MPU_QUERIES = (("get_tensor_model_parallel_world_size", "get_slice_parallel_world_size"),
                ("get_tensor_model_parallel_rank", "get_slice_parallel_rank"),
                ("get_data_parallel_world_size", "get_data_parallel_world_size"),
                ("get_data_parallel_rank", "get_data_parallel_rank"))


def _check_mpu(mpu, model) -> None:
    """Accept an ``mpu`` (Megatron's, or a DeepSpeed grid) that agrees with the module's own grid:
    the same tensor- and data-parallel sizes and ranks on this rank, where it answers those
    queries. The module's grid is what the engine uses (DeepSpeed's pipeline branch takes
    ``model.mpu()`` too; it asserts ``mpu is None``, which a drop-in need not)."""
    if mpu is None or mpu is model.mpu():
        return
    grid = model.mpu()
    for theirs, ours in _MPU_QUERIES:
        query = getattr(mpu, theirs, None) or getattr(mpu, ours, None)
        if query is None:
            continue
        got, want = query(), getattr(grid, ours)()
        if got != want:
            raise GPPConfigError(f"mpu.{query.__name__}() is {got} on rank {grid.global_rank} but the module's grid "
                                 f"says {want}: pass mpu=model.mpu() (or none), or build the module with the "
                                 "topology the mpu was made for (PipeModelDataParallelTopology(pp, mp, dp))")


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None, lr_scheduler=None,
               distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT, mpu=None, dist_init_required=None,
               collate_fn=None, config=None, mesh_param=None, config_params=None):
    """Initialize DeepSpeed; returns ``(engine, optimizer, training_dataloader, lr_scheduler)``.

    Takes what ``deepspeed.initialize`` takes. For a :class:`GraphPipelineModule` the engine is a
    :class:`GraphPipelineEngine`; the config's ``"graph_pipeline"`` section is validated first.
    """
    if is_dualpipev_module(model):
        # DeepSpeed's DualPipeV users: the same stages as a folded chain under "dualpipev".
        conversion = convert_dualpipev(model)
        config, config_params = conversion.config(_load_config(args, config, config_params)), None
        if args is not None and getattr(args, "deepspeed_config", None) is not None:
            args.deepspeed_config = None
        parse_graph_pipeline_config(config)   # an engine without folded schedules refuses them here, by name
        model = conversion.module()
    if not isinstance(model, GraphPipelineModule):
        out = deepspeed.initialize(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                                   training_data=training_data, lr_scheduler=lr_scheduler,
                                   distributed_port=distributed_port, mpu=mpu, dist_init_required=dist_init_required,
                                   collate_fn=collate_fn, config=config, mesh_param=mesh_param,
                                   config_params=config_params)
        release_own_shm()
        return out
    _check_mpu(mpu, model)
    config = _load_config(args, config, config_params)
    gpp_config = parse_graph_pipeline_config(config)
    spec = get_schedule(with_plan_schedule(gpp_config, model.plan_schedule).schedule)   # the schedule it will run
    check_tp_composes(model.placement, schedule=spec.name, asynchronous=spec.asynchronous,
                      stages_per_rank=model.placement.num_stages // model.placement.pipeline().num_stages,
                      config_tp=gpp_config.stage_tp)
    ds_config = {k: v for k, v in config.items() if k != CONFIG_KEY}
    check_gc_config(ds_config, gpp_config.gc_interval)
    # Per-stage degrees: the user's batch values describe the pipeline; DeepSpeed gets this rank's.
    ds_config = stage_batch_config(ds_config, model.placement.pipeline(), model.stage_id)
    rows = _rows_per_stage(config, model.placement)
    if rows is not None:
        check_captured_rows(model._entries, model.partition.stage_of, rows)
    if args is not None and getattr(args, "deepspeed_config", None) is not None:
        args.deepspeed_config = None  # the config travels as a dict from here on

    zero.partition_parameters.shutdown_init_context()
    dist.init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                          distributed_port=distributed_port, dist_init_required=dist_init_required)
    mpu = model.mpu()
    config_class = DeepSpeedConfig(ds_config, mpu)
    deepspeed.set_optimizer_flags(config_class, model)
    engine = GraphPipelineEngine(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                                 training_data=training_data, lr_scheduler=lr_scheduler, mpu=mpu,
                                 dist_init_required=dist_init_required, collate_fn=collate_fn, config=ds_config,
                                 config_class=config_class, gpp_config=gpp_config)
    zero.partition_parameters.restore_init_context()
    if gpp_config.gc_freeze:   # before DeepSpeed's own collection (disable_python_gc), which it makes cheap
        freeze_startup_heap()
    configure_python_gc(engine)
    release_own_shm()   # every rank has mapped every peer's shm workspace: nothing need stay in /dev/shm
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler
