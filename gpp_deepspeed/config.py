"""The ``"graph_pipeline"`` section of a DeepSpeed JSON config.

DeepSpeed silently accepts typos in its own ``"pipeline"`` dict; this section does not: an unknown
key is a :class:`~gpp_deepspeed.errors.GPPConfigError` that names it.

Example::

    {
      "train_micro_batch_size_per_gpu": 4,
      "gradient_accumulation_steps": 8,
      "graph_pipeline": {"schedule": "1f1b", "validate_schedule": true}
    }
"""

from typing import Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, PositiveInt, ValidationError

from .errors import GPPConfigError
from .schedule.registry import SCHEDULES

__all__ = ["CONFIG_KEY", "GraphPipelineConfig", "load_config", "parse_graph_pipeline_config", "with_plan_schedule"]

CONFIG_KEY = "graph_pipeline"

# The accepted schedule names are the registry's (gpp_deepspeed.schedule.SCHEDULES).
ScheduleName = Literal[tuple(SCHEDULES)]  # type: ignore[valid-type]


class GraphPipelineConfig(BaseModel):
    """Settings of the graph pipeline engine, read from ``config["graph_pipeline"]``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schedule: ScheduleName = "1f1b"
    """Training schedule: ``"1f1b"`` is the branch-aware synchronous 1F1B (PipeDream-Flush on a
    DAG, GraphPipe's default); ``"gpipe"`` runs every forward before any backward (more
    activation memory, useful as a baseline); ``"zb1"`` and ``"zb2"`` split each backward into
    input and weight gradients (zero-bubble ZB-H1 and a ZB-H2-like schedule, arXiv 2401.10241):
    ``zb1`` holds no more micro-batches than 1F1B's busiest stage, ``zb2`` up to about twice as
    many for a near-zero bubble; with activation checkpointing both recompute with torch's
    non-reentrant checkpoint (see :mod:`gpp_deepspeed.engine.backward`). ``"pipedream"``,
    ``"2bw"`` and ``"pipeoptim"`` are asynchronous: the pipeline never drains between batches
    (``engine.flush()`` drains it) and weights update inside it; see
    :mod:`gpp_deepspeed.schedule.asynchronous` for what each computes.

    Precedence: a schedule named here wins; otherwise a plan loaded with
    ``partition_method="plan.json"`` brings the schedule it was priced with (``gpp plan
    --schedules``); otherwise ``"1f1b"``."""

    stages_per_rank: int = Field(default=1, ge=1)
    """Stages each pipeline rank holds (virtual stages; Megatron's
    ``virtual_pipeline_model_parallel_size``): ``"interleaved"`` runs any number, ``"zbv"`` two.
    The module is cut into ``stages_per_rank`` x pipeline ranks stages and must be built with the
    same value (``GraphPipelineModule(..., stages_per_rank=v)``: it builds each rank's stages
    before the config is read); 1 is one stage per rank."""

    fold: Literal["looped", "v"] | list[int] | None = None
    """Where the stages sit: ``"looped"`` (stage ``s`` on rank ``s mod R``, Megatron's), ``"v"``
    (rank ``r`` holds stages ``r`` and ``2R - 1 - r``, ZB-V's) or the pipeline rank of every stage
    (a planner's fold). The module must be built with the same (``GraphPipelineModule(...,
    fold=...)``); ``"zbv"`` runs the V only."""

    stage_tp: list[int] | None = None
    """Tensor-parallel degree of each stage (issue 29), e.g. ``[2, 1, 2]``. The module builds the
    process groups, so this must equal what ``GraphPipelineModule(stage_tp=...)`` (or DeepSpeed's
    ``PipeModelDataParallelTopology``, or a plan's stages) gave it; it is checked, never applied.
    Default: whatever the module has."""

    stage_times: list[tuple[NonNegativeFloat, NonNegativeFloat, NonNegativeFloat, NonNegativeFloat]] | None = None
    """Each stage's forward, backward, input-gradient and weight-gradient seconds ``[F, B, I, W]``,
    that a schedule ordered on a simulated clock (``zbv``: each rank runs what is ready, by
    priority, as the clock says) and the transfers are ordered for. Every rank must give the same.
    Default: the plan's (``gpp plan`` records the times it priced a folded plan with), else unit
    times; a fold given by hand with stages of unequal cost runs a better order with them."""

    max_in_flight: PositiveInt | list[PositiveInt] | None = None
    """The micro-batches each pipeline rank may hold at once in ``zbv``'s order, counted once per
    stage that holds one (one int for every rank, or one per rank). Default: the plan's (``gpp
    plan`` records the caps it priced a fold under when they are not the default), else every rank
    the fold's largest bound (:func:`~gpp_deepspeed.schedule.greedy.fold_in_flight`: ZB-V's ``2p``
    on a V over a chain). Fewer hold less memory and leave more bubble; refused for the other
    schedules, whose orders no cap shapes."""

    early_receives: bool = True
    """Post every receive of activations and gradients as soon as its message is sent and wait for
    it just before its use (:func:`~gpp_deepspeed.schedule.lowering.post_early`, as
    torch.distributed.pipelining's runtime does), so it travels while the stage computes. Each
    stage may then hold the receive buffers of one more micro-batch; ``false`` receives each
    message in place, blocking, just before its use."""

    validate_schedule: bool = True
    """Check every stage's instruction list for deadlock and buffer misuse before running it; the
    deadlock check assumes NCCL's semantics (a send completes only when its receive is posted)."""

    print_stage_graph: bool = True
    """Print the stage graph (layers per stage, tensors per stage edge) on global rank 0."""

    print_memory: bool = True
    """Print each rank's memory for its stage (parameters, gradients, optimizer state, activation
    peak, process peak; :mod:`gpp_deepspeed.engine.memory`) on global rank 0, beneath the stage graph
    at ``initialize`` and again after the first step, when gradients, optimizer state and
    activations have been allocated. Gathering it is collective: every rank must have the same value."""

    activation_meter_steps: PositiveInt | Literal["until_steady", "every_step"] = "until_steady"
    """How many training steps (the first ones) the memory report's activation peak is measured
    over, by saved-tensor hooks around every forward (:class:`~gpp_deepspeed.engine.memory.ActivationMeter`).
    The hooks cost CPU time for every tensor autograd saves, in the forward and again in the
    backward (``benchmarks/activation_meter.py``), so after these steps forwards run without them
    and the peak stays what they measured. ``"until_steady"``: up to the first step that runs the
    schedule's steady program, after which every step holds what it held (one step for a
    synchronous schedule; an asynchronous one's first batches fill the never-draining pipeline),
    and every step under ``dynamic_shape``, whose micro-batches may change shape. ``"every_step"``:
    always (a model whose activations change from step to step in other ways)."""

    print_idle_fractions: bool = True
    """Every ``steps_per_print`` steps, print each stage's idle fraction in the last batch (time
    spent waiting for tensors or for sends to finish, over the batch's wall time) on global rank 0,
    after DeepSpeed's own loss and samples/sec line."""

    trace_dir: str | None = None
    """If set, every rank writes ``<trace_dir>/rank<global rank>.json``: a Chrome/Perfetto trace
    (chrome://tracing, ui.perfetto.dev) of the instructions it ran, one event per action."""

    trace_steps: int = Field(default=10, gt=0)
    """How many training steps the trace keeps (the first ones), so long runs stay small."""

    p2p_timeout_s: float = Field(default=1800.0, gt=0)
    """Seconds a stage waits for a tensor from another stage before it fails with an error that
    names the stage and rank it waited on (gloo would otherwise wait forever for a dead peer)."""

    watchdog: bool = True
    """Run the watchdog (:mod:`gpp_deepspeed.engine.watchdog`): every rank beats a counter in the
    rendezvous store and exits, naming the failed rank and stage, when a rank it exchanges data with
    dies or freezes, instead of waiting ``p2p_timeout_s``."""

    watchdog_timeout_s: float = Field(default=30.0, gt=0)
    """Seconds without a heartbeat after which a rank counts as dead or frozen. The heartbeat is a
    thread: a rank busy with a long step or a slow data loader keeps beating."""

    heartbeat_s: float = Field(default=1.0, gt=0)
    """Seconds between heartbeats (and between checks of the peers' heartbeats)."""

    gc_freeze: bool = True
    """At the end of ``initialize``, collect once and ``gc.freeze()`` every object made so far (the
    framework, the model, the engine), so that later cyclic collections never scan them: a full
    collection then costs what the steps allocated, not the whole heap (0.2-1 s on a CPU host,
    during which every rank that waits for this one waits too). Only cyclic garbage made before
    ``initialize`` and dropped after it is never collected. Process-wide
    (:mod:`gpp_deepspeed.engine.collector`)."""

    gc_interval: int = Field(default=0, ge=0)
    """With DeepSpeed's ``"disable_python_gc": true`` (the automatic collector off), every rank
    collects after every ``gc_interval``-th optimizer step, between batches, where no rank waits for
    another (Megatron-LM's ``--manual-gc-interval``); 0: only when the application calls
    ``engine.collect_python_gc()``. Refused without ``disable_python_gc``."""

    checkpoint_in_background: bool = False
    """``save_checkpoint`` returns once the state is copied to CPU memory; the files are written,
    and the checkpoint committed (``latest``), on a thread while training goes on
    (:mod:`gpp_deepspeed.engine.background`). A rank lost before its files are written leaves
    ``latest`` at the last complete checkpoint."""


def load_config(config: str | dict[str, Any]) -> dict[str, Any]:
    """A DeepSpeed config as the dict ``gpp_deepspeed.initialize`` reads: a path to a JSON (or
    hjson) file, a base64-encoded string or a dict, parsed as DeepSpeed parses
    ``--deepspeed_config`` (a key given twice is an error). Scripts that need the config's values
    themselves read it with this::

        config = gpp_deepspeed.load_config(args.deepspeed_config)
        lr = config["optimizer"]["params"]["lr"]
    """
    from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config  # deepspeed only when called
    return dict(load_ds_config(config))


def parse_graph_pipeline_config(ds_config: Mapping[str, Any] | None) -> GraphPipelineConfig:
    """Validate the ``graph_pipeline`` section of a DeepSpeed config dict.

    >>> parse_graph_pipeline_config({"graph_pipeline": {"schedule": "gpipe"}}).schedule
    'gpipe'
    """
    section = (ds_config or {}).get(CONFIG_KEY, {})
    if not isinstance(section, Mapping):
        raise GPPConfigError(f'config["{CONFIG_KEY}"] must be a JSON object, got {type(section).__name__}')
    try:
        return GraphPipelineConfig(**section)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            key = ".".join(str(p) for p in err["loc"])
            if err["type"] == "extra_forbidden":
                valid = ", ".join(GraphPipelineConfig.model_fields)
                problems.append(f'unknown key "{CONFIG_KEY}.{key}" (valid keys: {valid})')
            else:
                problems.append(f'"{CONFIG_KEY}.{key}": {err["msg"]}')
        raise GPPConfigError("invalid DeepSpeed config: " + "; ".join(problems)) from None


def with_plan_schedule(config: GraphPipelineConfig, plan_schedule: str | None) -> GraphPipelineConfig:
    """``config`` running the plan's schedule, unless the config names a schedule itself.

    >>> with_plan_schedule(GraphPipelineConfig(), "zb1").schedule
    'zb1'
    >>> with_plan_schedule(GraphPipelineConfig(schedule="1f1b"), "zb1").schedule
    '1f1b'
    """
    if plan_schedule is None or "schedule" in config.model_fields_set:
        return config
    return parse_graph_pipeline_config({CONFIG_KEY: {**config.model_dump(exclude_unset=True), "schedule": plan_schedule}})
