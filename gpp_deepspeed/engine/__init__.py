"""The DeepSpeed side: the pipeline module, the engine, their instructions and transfers.

The only package of gpp_deepspeed that imports deepspeed's runtime.
"""

from .engine import GraphPipelineEngine
from .instructions import (GraphPipeSchedule, RecvActivationFrom, RecvGradFrom, SendActivationTo, SendGradTo,
                           WaitSends)
from .module import PARTITION_METHODS, GraphPipelineModule
from .shm import release_own_shm

__all__ = ["GraphPipelineEngine", "GraphPipelineModule", "GraphPipeSchedule", "PARTITION_METHODS",
           "RecvActivationFrom", "RecvGradFrom", "SendActivationTo", "SendGradTo", "WaitSends", "release_own_shm"]
