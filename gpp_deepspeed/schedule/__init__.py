"""The schedule as data: IR, generators, lowering passes, validator and simulator.

Nothing in this package imports torch.distributed or deepspeed.
"""

from .ir import Action, ActionKind, Schedule, format_schedule
from .generators import (SCHEDULES, add_epilogue, add_load, add_send_recv, build_schedule, forward_only,
                         get_schedule, gpipe, lower, one_f_one_b, warmup_forwards)
from .lowering import (BufferSlots, add_release, assign_buffers, group_for_rendezvous, group_p2p, num_slots,
                       order_transfers)
from .validate import MODES, Timeline, default_duration, simulate, validate_schedule
from .zero_bubble import peak_in_flight, unit_split_duration, zb1, zb2
from .asynchronous import (ASYNC_SCHEDULES, AsyncReport, async_segment, async_slots, is_async, predicted_updates,
                           steady_batch_idx, validate_async)

__all__ = [
    "Action", "ActionKind", "Schedule", "format_schedule",
    "SCHEDULES", "add_epilogue", "add_load", "add_send_recv", "build_schedule", "forward_only", "get_schedule",
    "gpipe", "lower", "one_f_one_b", "warmup_forwards",
    "BufferSlots", "add_release", "assign_buffers", "group_for_rendezvous", "group_p2p", "num_slots", "order_transfers",
    "MODES", "Timeline", "default_duration", "simulate", "validate_schedule",
    "peak_in_flight", "unit_split_duration", "zb1", "zb2",
    "ASYNC_SCHEDULES", "AsyncReport", "async_segment", "async_slots", "is_async", "predicted_updates", "steady_batch_idx",
    "validate_async",
]
