"""The schedule as data: IR, generators, lowering passes, programs, validator and simulator.

Nothing in this package imports torch.distributed or deepspeed.
"""

from .ir import KINDS, RELEASES, Action, ActionKind, Buffer, KindSpec, Schedule, Segment, format_schedule
from .generators import forward_only, gpipe, one_f_one_b, warmup_forwards
from .zero_bubble import peak_in_flight, unit_split_duration, zb1, zb2
from .asynchronous import WeightRule, async_compute, predicted_updates, steady_batch_idx
from .registry import SCHEDULES, ScheduleSpec, get_schedule, is_async
from .lowering import (BufferSlots, add_epilogue, add_layouts, add_load, add_release, add_send_recv, assign_buffers, defer_sends,
                       drop_frozen_backward, group_for_rendezvous, group_p2p, lower, merge_backward, num_slots,
                       order_transfers)
from .validate import MODES, Timeline, check_lists, check_weight_versions, default_duration, simulate, validate_schedule
from .program import (AsyncProgram, AsyncReport, Program, ProgramFactory, build_program, build_schedule, validate_async,
                      validate_program)

__all__ = [
    "KINDS", "RELEASES", "Action", "ActionKind", "Buffer", "KindSpec", "Schedule", "Segment", "format_schedule",
    "forward_only", "gpipe", "one_f_one_b", "warmup_forwards",
    "peak_in_flight", "unit_split_duration", "zb1", "zb2",
    "WeightRule", "async_compute", "predicted_updates", "steady_batch_idx",
    "SCHEDULES", "ScheduleSpec", "get_schedule", "is_async",
    "BufferSlots", "add_epilogue", "add_layouts", "add_load", "add_release", "add_send_recv", "assign_buffers", "defer_sends",
    "drop_frozen_backward", "group_for_rendezvous", "group_p2p", "lower", "merge_backward", "num_slots",
    "order_transfers",
    "MODES", "Timeline", "check_lists", "check_weight_versions", "default_duration", "simulate", "validate_schedule",
    "AsyncProgram", "AsyncReport", "Program", "ProgramFactory", "build_program", "build_schedule", "validate_async",
    "validate_program",
]
