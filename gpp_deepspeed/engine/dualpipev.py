"""DeepSpeed's ``DualPipeVModule`` as a drop-in: the same layers as a folded GraphPipelineModule.

DeepSpeed 0.19.8's ``DualPipeVModule`` (``deepspeed/runtime/pipe/dualpipev.py``) cuts a layer list
into ``2 R`` stages for ``R`` pipeline ranks (its ``parts``, by its ``partition_method``); rank ``r``
builds stage ``r`` (phase 0) and stage ``2 R - 1 - r`` (phase 1), and ``DualPipeVEngine`` runs
DeepSeek-V3's DualPipeV on them. :func:`convert_dualpipev` turns such a module into the chain of
those ``2 R`` stages, folded in the same V (``graph_pipeline.fold``) and run under
``"schedule": "dualpipev"`` (:func:`~gpp_deepspeed.schedule.virtual.dualpipev_orders`, torch's
``ScheduleDualPipeV`` order), so ``gpp_deepspeed.initialize`` trains it on the graph pipeline
engine. Each rank keeps the layers DeepSpeed already built for it (the V gives it the same stages),
so the weights are DeepSpeed's, whatever its seeding.

What does not convert is refused by name: tied layers (``TiedLayerSpec``), data-parallel replicas
of the pipeline, and a ``graph_pipeline`` config that names another schedule or fold.

Glossary
--------
conversion
    :class:`DualPipeVConversion`: the layer list, the stage of every layer, the fold and the
    ``graph_pipeline`` config section that run a ``DualPipeVModule`` on this package's engine.

Representative use (what ``gpp_deepspeed.initialize`` does with a ``DualPipeVModule``)::

    conversion = convert_dualpipev(model)              # DualPipeVModule -> DualPipeVConversion
    config = conversion.config(config)                 # + "graph_pipeline": {"schedule": "dualpipev", ...}
    module = conversion.module()                       # GraphPipelineModule of 2R stages
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from deepspeed.pipe import LayerSpec, TiedLayerSpec
from deepspeed.runtime.pipe.dualpipev import DualPipeVModule

from ..config import CONFIG_KEY
from ..errors import GPPConfigError
from ..schedule.virtual import Fold
from .compat import layer_specs

__all__ = ["DualPipeVConversion", "convert_dualpipev", "dualpipev_conversion", "is_dualpipev_module"]

SCHEDULE = "dualpipev"


def is_dualpipev_module(model: Any) -> bool:
    """True for DeepSpeed's ``DualPipeVModule`` (and its subclasses)."""
    return isinstance(model, DualPipeVModule)


@dataclass(frozen=True)
class DualPipeVConversion:
    """A ``DualPipeVModule`` as a chain of ``2 R`` stages folded in a V on ``R`` ranks.

    ``layers`` is the layer list (DeepSpeed's, with the layers this rank built in place of their
    specs), ``stage_of`` the stage of each layer by its name in a GraphPipelineModule
    (``"layer<i>"``, DeepSpeed's numbering), ``fold`` the rank of each stage; ``module_kwargs`` the
    rest of what the GraphPipelineModule is built with (loss, seeds, activation checkpointing)."""

    layers: tuple
    stage_of: dict[str, int]
    num_ranks: int
    fold: tuple[int, ...]
    module_kwargs: dict = field(default_factory=dict)

    @property
    def num_stages(self) -> int:
        return len(self.fold)

    @property
    def graph_pipeline(self) -> dict:
        """The ``graph_pipeline`` config section that runs the fold under DualPipeV."""
        return {"schedule": SCHEDULE, "stages_per_rank": 2, "fold": list(self.fold)}

    def config(self, ds_config: dict) -> dict:
        """``ds_config`` with :attr:`graph_pipeline` merged into its ``graph_pipeline`` section;
        a section naming another schedule, stage count per rank or fold is refused by name."""
        section = dict(ds_config.get(CONFIG_KEY, {}))
        for key, value in self.graph_pipeline.items():
            if key in section and section[key] != value:
                raise GPPConfigError(f'a DualPipeVModule runs graph_pipeline.{key} = {value!r}; the config says '
                                     f"{section[key]!r}: drop it from the config")
            section[key] = value
        return {**ds_config, CONFIG_KEY: section}

    def module(self):
        """The GraphPipelineModule of the ``2 R`` stages (manual partition ``stage_of``), folded in
        the V (``fold``)."""
        from .module import GraphPipelineModule

        return GraphPipelineModule(list(self.layers), num_stages=self.num_stages, partition_method=dict(self.stage_of),
                                   fold=list(self.fold), **self.module_kwargs)


def dualpipev_conversion(layers: Sequence[Any], parts: Sequence[int], *, num_ranks: int,
                         module_kwargs: dict | None = None) -> DualPipeVConversion:
    """The conversion of a layer list cut by ``parts`` (DeepSpeed's ``PipelineModule.parts``:
    stage ``s`` holds layers ``parts[s] .. parts[s + 1] - 1``, ``2 R`` stages) for ``num_ranks``
    ranks: the chain of the stages, folded in DualPipeV's V (rank ``r``: stages ``r`` and
    ``2 R - 1 - r``).

    >>> c = dualpipev_conversion(["a", "b", "c", "d", "e", "f"], [0, 2, 3, 4, 6], num_ranks=2)
    >>> c.stage_of, c.fold, c.graph_pipeline["schedule"]
    ({'layer0': 0, 'layer1': 0, 'layer2': 1, 'layer3': 2, 'layer4': 3, 'layer5': 3}, (0, 1, 1, 0), 'dualpipev')
    """
    if len(parts) != 2 * num_ranks + 1 or parts[0] != 0 or parts[-1] != len(layers):
        raise GPPConfigError(f"DualPipeV cuts {len(layers)} layers into {2 * num_ranks} stages; its boundaries "
                             f"{list(parts)} do not")
    tied = [(i, spec.key) for i, spec in enumerate(layers) if isinstance(spec, TiedLayerSpec)]
    if tied:
        raise GPPConfigError(f"layer {tied[0][0]} is a TiedLayerSpec (key {tied[0][1]!r}): tied layers of a "
                             "DualPipeVModule do not convert (the folded engine shares no weights between a rank's "
                             "stages yet); untie them")
    empty = [s for s in range(2 * num_ranks) if parts[s] == parts[s + 1]]
    if empty:
        raise GPPConfigError(f"DualPipeV's stage {empty[0]} holds no layer ({len(layers)} layers for "
                             f"{2 * num_ranks} stages): give it more layers or fewer ranks")
    stage_of = {f"layer{i}": s for s in range(2 * num_ranks) for i in range(parts[s], parts[s + 1])}
    return DualPipeVConversion(layers=tuple(layers), stage_of=stage_of, num_ranks=num_ranks,
                               fold=Fold.v_shape(num_stages=2 * num_ranks).rank_of, module_kwargs=module_kwargs or {})


def convert_dualpipev(model: DualPipeVModule) -> DualPipeVConversion:
    """The conversion of a built ``DualPipeVModule`` (see the module docstring): its layer specs,
    its partition (``parts``), its loss and activation checkpointing, and on this rank the layers
    it built (both phases) in place of their specs."""
    topology = model.topology()
    if topology.get_dim("data") != 1 or set(topology.get_axis_names()) - {"pipe", "data"}:
        raise GPPConfigError(f"a DualPipeVModule on the topology {topology.get_axis_names()} with "
                             f"{topology.get_dim('data')} data-parallel replicas does not convert: only a pipeline "
                             "of one replica does")
    num_ranks = topology.get_dim("pipe")
    layers = list(layer_specs(model))
    for phase, (start, stop) in enumerate(model.phase_bounds):
        for i, built in zip(range(start, stop), model.phase_funcs[phase]):
            if isinstance(layers[i], LayerSpec):
                layers[i] = built    # DeepSpeed's own weights for the layers this rank holds
    kwargs = dict(loss_fn=model.loss_fn, base_seed=model.base_seed, seed_layers=model.seed_layers,
                  seed_fn=model.seed_fn, activation_checkpoint_interval=model.activation_checkpoint_interval,
                  activation_checkpoint_func=model.activation_checkpoint_func,
                  checkpointable_layers=model.checkpointable_layers)
    return dualpipev_conversion(layers, model.parts, num_ranks=num_ranks, module_kwargs=kwargs)
