"""The front end: an ``nn.Module`` or a Hugging Face directory in, a layer list out.

Everything here runs on one process before any engine exists, and nothing here imports
:mod:`gpp_deepspeed.engine` (``tests/test_import_boundaries.py`` checks it); the layers it returns
are DeepSpeed ``LayerSpec`` objects that :class:`~gpp_deepspeed.GraphPipelineModule` and
:class:`~gpp_deepspeed.GraphModel` build.

========================  ==========================================================================
module                    what it holds
========================  ==========================================================================
:mod:`.capture`           :func:`capture`: trace a module into layers, graph inputs and an output
:mod:`._tracing`          the tracers behind it, and errors that quote the model's own line
:mod:`._batch`            the batch dimension kept symbolic in shape-specialised traces
:mod:`.meta`              deferred materialisation of layers built on the meta device
:mod:`.hf`                the Hugging Face model inside a captured module; a directory's names
:mod:`.pretrained`        :func:`load_pretrained`: captured layers that read a Hugging Face directory
========================  ==========================================================================

Saving a pipeline as a Hugging Face directory is collective, so ``save_pretrained`` lives beside
the engine (:mod:`gpp_deepspeed.engine.pretrained`).
"""

from .capture import CapturedLayerSpec, CapturedModel, CapturedTiedLayerSpec, capture
from .hf import HFModelInfo
from .pretrained import PretrainedWeights, load_pretrained

__all__ = ["capture", "CapturedModel", "CapturedLayerSpec", "CapturedTiedLayerSpec", "HFModelInfo",
           "PretrainedWeights", "load_pretrained"]
