"""The DeepSpeed side: ``initialize``, the pipeline module, the engine and its rooms (instructions,
buffers, transfers, backward, ZeRO), ``save_pretrained``.

The only package of gpp_deepspeed that imports deepspeed's runtime. Importing it bounds every wait
on a torch extension build lock in this process (:mod:`.startup`), so that a script's own
``deepspeed.init_distributed()``, which builds DeepSpeed's shm op, cannot wait for ever on a lock
that a killed process left behind.
"""

from .startup import guard_build_locks

guard_build_locks()

from .engine import GraphPipelineEngine  # noqa: E402
from .instructions import GraphPipeSchedule, Transfers, WaitSends
from .module import PARTITION_METHODS, GraphPipelineModule
from .shm import release_own_shm

__all__ = ["GraphPipelineEngine", "GraphPipelineModule", "GraphPipeSchedule", "PARTITION_METHODS",
           "Transfers", "WaitSends", "release_own_shm"]
