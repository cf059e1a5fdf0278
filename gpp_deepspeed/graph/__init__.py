"""Pure graph code: the layer DAG, partitions into stages and the stage DAG.

Nothing in this package imports torch.distributed or deepspeed.
"""

from .ir import LayerGraph, LayerNode, TensorRef, build_layer_graph
from .stages import Partition, StageEdge, StageGraph, StageSpec, derive_partition
from .partition import balanced_partition, sequential_partition

__all__ = [
    "LayerGraph", "LayerNode", "TensorRef", "build_layer_graph",
    "Partition", "StageEdge", "StageGraph", "StageSpec", "derive_partition",
    "balanced_partition", "sequential_partition",
]
