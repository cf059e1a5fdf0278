"""Golden schedule files: the printed program of every schedule on a few stage graphs, checked in
as text (``tests/golden/schedules/<graph>.txt``), so that a change in any schedule, lowering pass
or buffer assignment shows up as a diff (pure, no torch).

A schedule of several stages per rank (``interleaved``, ``zbv``, ``dualpipev``) prints its programs on
the schedule's own fold of the graph, one list per rank (a V needs an even number of stages:
on the others a line says so); ``chain4`` is a chain each of them folds.

A synchronous schedule prints its training batch twice: as a steady batch runs it, and with the
layout actions (``SEND_L``/``RECV_L``) that a first batch, or every batch under ``dynamic_shape``,
runs. An asynchronous one prints its batches up to the first steady one and the flush after the batch
that follows, with layouts (as the engine runs them). Every graph also prints its evaluation program
(forwards only, the same for every schedule).

Regenerate after an intended change, and review the diff::

    .venv/bin/python tests/test_golden_schedules.py
"""

from __future__ import annotations

import difflib
import sys
from pathlib import Path

import pytest

from gpp_deepspeed.graph.stages import StageEdge, StageGraph
from gpp_deepspeed.schedule import SCHEDULES, AsyncProgram, build_program, steady_batch_idx

GOLDEN = Path(__file__).resolve().parent / "golden" / "schedules"
MICRO_BATCHES = 4
REGENERATE = ".venv/bin/python tests/test_golden_schedules.py"

GRAPHS = {
    # three stages in a row
    "chain3": StageGraph.chain(3),
    # four stages in a row (two per rank, looped or in a V)
    "chain4": StageGraph.chain(4),
    # stage 0 feeds stage 1 and, over a skip, stage 2, which merges both (a fan-in)
    "skip": StageGraph(num_stages=3, edges=(StageEdge(0, 1, ()), StageEdge(0, 2, ()), StageEdge(1, 2, ())),
                       output_stage=2),
    # a fork into two branch stages and their merge
    "diamond": StageGraph(num_stages=4, edges=(StageEdge(0, 1, ()), StageEdge(0, 2, ()), StageEdge(1, 3, ()),
                                               StageEdge(2, 3, ())), output_stage=3),
    # a chain whose middle stage also reads a graph input (it loads the batch too)
    "middle_loads": StageGraph(num_stages=3, edges=(StageEdge(0, 1, ()), StageEdge(1, 2, ())), output_stage=2,
                               loading=frozenset({0, 1, 2})),
}


def golden_text(name: str) -> str:
    """Every schedule's printed program on graph ``name``, in registry order."""
    graph = GRAPHS[name]
    parts = [f"# {name}: {graph.num_stages} stages, edges "
             + " ".join(f"{e.src}->{e.dst}" for e in graph.edges)
             + f", loading {sorted(graph.loading)}, {MICRO_BATCHES} micro-batches. Regenerate: {REGENERATE}",
             str(build_program(graph, MICRO_BATCHES, train=False))]
    for schedule, spec in SCHEDULES.items():
        if spec.folded is not None and spec.folded.fold == "v" and graph.num_stages % 2:
            parts.append(f'program "{schedule}": a V needs an even number of stages, not {graph.num_stages}')
            continue
        if not spec.asynchronous:
            parts.append(str(build_program(graph, MICRO_BATCHES, schedule=schedule)))
            parts.append(str(build_program(graph, MICRO_BATCHES, schedule=schedule, layouts=True)))
            continue
        pipeline = AsyncProgram(graph, MICRO_BATCHES, schedule=schedule, layouts=True)
        steady = steady_batch_idx(graph, MICRO_BATCHES)
        parts += [str(pipeline.batch(k)) for k in range(steady + 1)]
        parts.append(str(pipeline.flush(steady + 1)))
    return "\n\n".join(parts) + "\n"


@pytest.mark.parametrize("name", GRAPHS)
def test_every_schedules_program_is_its_golden_file(name):
    path = GOLDEN / f"{name}.txt"
    assert path.exists(), f"{path} is missing; regenerate: {REGENERATE}"
    expected, got = path.read_text(), golden_text(name)
    diff = "".join(difflib.unified_diff(expected.splitlines(True), got.splitlines(True), str(path), "now", n=1))
    assert got == expected, f"the programs changed (review, then regenerate: {REGENERATE}):\n{diff[:6000]}"


def test_the_golden_files_cover_every_registered_schedule_and_a_changed_program_shows_as_a_diff():
    text = (GOLDEN / "chain3.txt").read_text()
    for schedule in SCHEDULES:
        assert f'program "{schedule}"' in text, schedule
    # The same check on a different program must fail: zb1's batch is not 1F1B's.
    assert str(build_program(GRAPHS["chain3"], MICRO_BATCHES, schedule="zb1")) in text
    assert str(build_program(GRAPHS["chain3"], MICRO_BATCHES, schedule="1f1b")).replace('"1f1b"', '"zb1"') not in text


def main() -> None:
    GOLDEN.mkdir(parents=True, exist_ok=True)
    for name in GRAPHS:
        path = GOLDEN / f"{name}.txt"
        path.write_text(golden_text(name))
        print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
