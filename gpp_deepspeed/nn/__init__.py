"""Torch-only building blocks below both the engine and the profiler.

Nothing here imports DeepSpeed, :mod:`gpp_deepspeed.engine` or :mod:`gpp_deepspeed.frontend`
(``tests/test_import_boundaries.py`` checks it).

========================  ==========================================================================
module                    what it holds
========================  ==========================================================================
:mod:`.dag`               the layer-DAG interpreter (:func:`run_layers`) and the value helpers it uses
:mod:`.split_backward`    a backward split into input gradients now and weight gradients later
:mod:`.layer_dict`        ``LayerDict``: modules by layer name, names like ``to`` or ``train`` included
========================  ==========================================================================
"""

from .dag import call_layer, port_leaves, resolve, run_layer, run_layers, tensors_in
from .layer_dict import LayerDict
from .split_backward import WeightGrad, backward_input

__all__ = ["run_layer", "run_layers", "call_layer", "resolve", "tensors_in", "port_leaves", "WeightGrad",
           "backward_input", "LayerDict"]
