"""The compute times a folded program is made for (``graph_pipeline.stage_times``, a plan's
``stage_times``): ``zbv`` orders each rank's actions on a simulated clock, so the program the
engine runs is the one the fold search priced only when both use the same times (pure Python, no
processes)."""

from __future__ import annotations

import pytest

from gpp_deepspeed.config import parse_graph_pipeline_config
from gpp_deepspeed.errors import GPPConfigError
from gpp_deepspeed.graph.stages import StageEdge, StageGraph
from gpp_deepspeed.planner.fold_search import search_fold
from gpp_deepspeed.schedule import ProgramFactory, build_program, simulate, validate_program
from gpp_deepspeed.schedule.greedy import Fold, stage_duration

# Two branches of two half-stages each into a four-stage trunk. The branches' stages take no input
# gradient (I costs nothing, as a branch's first layer), the trunk's backward twice a forward.
BRANCHES = StageGraph(num_stages=8, output_stage=7, loading=frozenset({0, 2}),
                      edges=tuple(StageEdge(a, b, ()) for a, b in ((0, 1), (2, 3), (1, 4), (3, 4), (4, 5), (5, 6),
                                                                    (6, 7))))
TIMES = [(1, 1, 0, 1)] * 4 + [(1, 2, 1, 1)] * 4
M = 8


def test_a_zbv_program_made_for_the_stage_times_runs_in_the_time_the_fold_search_priced():
    duration = stage_duration(TIMES, 8)
    choice = search_fold(BRANCHES, M, num_ranks=4, duration=duration, schedules=("zbv", ))
    timed = build_program(BRANCHES, M, schedule="zbv", fold=choice.fold, duration=duration)
    unit = build_program(BRANCHES, M, schedule="zbv", fold=choice.fold)
    validate_program(timed, BRANCHES)   # a compute priced at nothing (the branches' I) orders its transfers too

    def step(program):
        return simulate(program.actions, duration=duration, rank_of=choice.fold.rank_of).makespan
    assert step(timed) == choice.makespan
    assert step(unit) > choice.makespan   # the unit-time order, on the same fold, is slower


def test_the_engines_program_factory_builds_the_program_for_the_times_it_is_given():
    duration = stage_duration(TIMES, 8)
    fold = search_fold(BRANCHES, M, num_ranks=4, duration=duration, schedules=("zbv", )).fold
    made = ProgramFactory(BRANCHES, schedule="zbv", fold=fold, duration=duration).program(M)
    assert made.actions == build_program(BRANCHES, M, schedule="zbv", fold=fold, duration=duration).actions
    assert made.actions != ProgramFactory(BRANCHES, schedule="zbv", fold=fold).program(M).actions


@pytest.mark.parametrize("times, culprit", [([(1, 1, 0, 1)] * 7, "8 stages"), ([(1, 1, 0)] * 8, "four"),
                                            ([(1, 1, -1, 1)] * 8, "non-negative")])
def test_stage_times_that_do_not_price_every_stage_are_refused_by_name(times, culprit):
    with pytest.raises(GPPConfigError, match=f"stage_times .*{culprit}"):
        stage_duration(times, 8)


def test_the_config_takes_four_non_negative_times_per_stage():
    assert parse_graph_pipeline_config({"graph_pipeline": {"stage_times": [[1, 2, 1, 1]]}}).stage_times == [(1, 2, 1, 1)]
    for bad in ([[1, 2, 1]], [[1, 2, -1, 1]]):
        with pytest.raises(GPPConfigError, match="graph_pipeline.stage_times"):
            parse_graph_pipeline_config({"graph_pipeline": {"stage_times": bad}})


def test_a_program_whose_input_gradients_cost_nothing_keeps_every_send_after_its_compute():
    # The half-layer stages of peers.py's four branches on the fold the search picks for them:
    # each branch's first layer (both halves) takes no input gradient. Transfers are ordered by a
    # simulation, where a compute priced at nothing ended as it began: its send tied with it and
    # was placed before it ("1SEND_B14@0 is ordered before the compute that produces it").
    pairs = ((0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (6, 7), (8, 9), (10, 11), (5, 12), (7, 12), (9, 12), (11, 12),
             (12, 13), (13, 14), (14, 15))
    graph = StageGraph(num_stages=16, output_stage=15, loading=frozenset({0, 6, 8, 10}),
                       edges=tuple(StageEdge(a, b, ()) for a, b in pairs))
    sources = {0, 1, 6, 7, 8, 9, 10, 11}
    times = [(1, 1, 0, 1) if s in sources else (1, 2, 1, 1) for s in range(16)]
    fold = Fold((0, 1, 2, 3, 4, 5, 6, 5, 2, 3, 7, 4, 0, 7, 6, 1))
    validate_program(build_program(graph, 16, schedule="zbv", fold=fold, duration=stage_duration(times, 16)), graph)
