"""The package's error hierarchy.

Every error a user can cause is a :class:`GPPConfigError`, which is also a ``ValueError``,
and its message names the culprit (the layer, the stage, the config key) and the fix.
``assert`` is kept for internal invariants only.
"""

__all__ = ["GPPError", "GPPConfigError", "GraphError", "PartitionError", "CheckpointError", "ScheduleError",
           "InfeasiblePlanError", "SearchLimitError"]


class GPPError(Exception):
    """Base class of every error raised by gpp_deepspeed."""


class GPPConfigError(GPPError, ValueError):
    """Bad user input: a model description, a partition, a config section or a batch."""


class GraphError(GPPConfigError):
    """The layer graph is invalid (cycle, unknown input, duplicate name, dangling layer)."""


class PartitionError(GPPConfigError):
    """A partition of layers into stages is invalid (missing layer, cycle between stages, ...)."""


class CheckpointError(GPPConfigError):
    """A checkpoint does not match the model (names, shapes) or is not a checkpoint."""


class ScheduleError(GPPError):
    """A schedule is malformed or would deadlock."""


class InfeasiblePlanError(GPPError):
    """No plan satisfies the constraints (memory per device, device count, micro-batch sizes)."""


class SearchLimitError(GPPError):
    """A search stopped at its state limit instead of running for hours (Piper's downset cap)."""
