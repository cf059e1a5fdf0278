"""The GraphPipe paper's models (arXiv 2406.17145, Appendix A.2) as layer DAGs.

A model is first a pure :class:`ModelDesc` (sizes and edges, no torch): the analytic cost model
prices it into a :class:`~gpp_deepspeed.planner.CostDB` for any device, and
:func:`build_layers` turns it into the ``GraphLayerSpec`` list the runtime trains, with the
same layer names. ::

    desc = multimodal_transformer(granularity="sublayer")    # the paper's MMT, 4 x 8 layers
    db = analytic_costs(desc, V100_SUMMIT)                   # CostDB for the planners
    layers = build_layers(tiny("mmt"))                       # a CPU-sized twin to train

``build_layers``, ``make_batch`` and ``loss_fn`` load torch on first use; the rest is pure.
"""


from .._lazy import lazy_names
from .analytic import (A100_80GB, DEFAULT_MICRO_BATCHES, DEVICES, H100_80GB, V100_SUMMIT, DeviceSpec,
                       analytic_costs, layer_flops, layer_ops, layer_stash_bytes, layer_times, optimizer_factor)
from .builders import BUILDERS, TINY, candle_uno, dlrm, multimodal_transformer, sequential_transformer, tiny
from .desc import InputDesc, LayerDesc, ModelDesc, output_elements, param_count

_LAZY = {"build_layers": ".torch_layers", "make_batch": ".torch_layers", "loss_fn": ".torch_layers"}

__all__ = [
    "InputDesc", "LayerDesc", "ModelDesc", "param_count", "output_elements",
    "multimodal_transformer", "sequential_transformer", "dlrm", "candle_uno", "BUILDERS", "TINY", "tiny",
    "DeviceSpec", "V100_SUMMIT", "A100_80GB", "H100_80GB", "DEVICES", "DEFAULT_MICRO_BATCHES",
    "optimizer_factor", "layer_ops", "layer_flops", "layer_stash_bytes", "layer_times", "analytic_costs",
    "build_layers", "make_batch", "loss_fn",
]


__getattr__, __dir__ = lazy_names(__name__, _LAZY, __all__, globals_=globals())
