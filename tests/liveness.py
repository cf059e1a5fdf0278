"""A brute-force oracle for buffer slots, from a program's text alone.

It reads each action's printed form (``"0F3"``, ``"(0SEND_F3@1;0RECV_B1@1)P2P"``), not the schedule
package's tables or validator: a micro-batch is live on a stage from the first action that names it
and uses its buffers to the last action that names it (its last release, in a lowered program).
Two micro-batches whose live ranges overlap must not share a slot, and a stage needs exactly as many
slots as it ever has micro-batches live at once.
"""

from __future__ import annotations

import re

_OP = re.compile(r"^(\d+)([A-Z_]+)(\d*)(?:@\d+)?$")
# Actions that name a micro-batch but hold none of its buffers: a received layout (a header the
# transport keeps per peer) and the weight-version actions, whose index names a version.
_NO_BUFFER = {"RECV_L", "STASH", "PREDICT", "PREDICT_INPLACE", "RESTORE", "RETIRE"}


def live_ranges(actions) -> dict[int, tuple[int, int]]:
    """``{micro-batch: (first, last)}`` positions in one stage's list, read from its text."""
    ranges: dict[int, tuple[int, int]] = {}
    for i, action in enumerate(actions):
        text = str(action)
        ops = text[1:-len(")P2P")].split(";") if text.startswith("(") else [text]
        for op in ops:
            _, kind, mb = _OP.match(op).groups()
            if mb and kind not in _NO_BUFFER:
                first, _ = ranges.get(int(mb), (i, i))
                ranges[int(mb)] = (first, i)
    return ranges


def check_slots(schedule, slots) -> None:
    """Every live micro-batch has a slot, no two overlapping ones share it, and each stage uses no
    more slots than its most micro-batches live at once (``slots[stage][mb]``)."""
    for s, actions in schedule.items():
        ranges = live_ranges(actions)
        assert set(ranges) <= set(slots[s]), (s, sorted(set(ranges) - set(slots[s])))
        for j, (a, b) in ranges.items():
            for k, (c, d) in ranges.items():
                if j < k and a <= d and c <= b:
                    assert slots[s][j] != slots[s][k], f"stage {s}: micro-batches {j} and {k} live together in slot " \
                                                       f"{slots[s][j]}"
        most = max((sum(a <= i <= b for a, b in ranges.values()) for i in range(len(actions))), default=0)
        assert len({slots[s][j] for j in ranges}) == most, (s, most, slots[s])
