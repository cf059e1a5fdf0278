"""Receives posted as soon as their message is sent and waited for at their use
(:func:`gpp_deepspeed.schedule.lowering.post_early`), against the same schedule with every receive
completed in place: what the validator checks of the waits, what the simulator says they buy, and
that every synchronous schedule keeps its order of compute. Training with them is the rest of the
suite (``early_receives`` is on by default; ``test_strict_transport`` runs a case with it off)."""

import pytest

from gpp_deepspeed.errors import ScheduleError
from gpp_deepspeed.graph import StageGraph
from gpp_deepspeed.schedule import SCHEDULES, Action, build_program, simulate
from gpp_deepspeed.schedule.ir import ActionKind as K
from gpp_deepspeed.schedule.validate import check_lists
from test_golden_schedules import GRAPHS

# Every synchronous schedule on every golden graph it runs on (a V needs an even number of stages).
PAIRS = [(graph, name) for graph in GRAPHS for name, spec in SCHEDULES.items() if not spec.asynchronous
         and not (spec.folded is not None and spec.folded.fold == "v" and GRAPHS[graph].num_stages % 2)]


def _programs(graph, name, m=8):
    return build_program(graph, m, schedule=name), build_program(graph, m, schedule=name, early=False)


def _compute(actions):
    return [a for a in actions if a.kind is K.FORWARD or a.kind.spec.backward]


def _posted_before(actions):
    """Each data receive: how many compute actions of its list come before it."""
    out, done = {}, 0
    for a in actions:
        if a.kind is K.FORWARD or a.kind.spec.backward:
            done += 1
        for op in a.parts:
            if op.completion is not None and not op.kind.spec.completes:
                out[(op.stage_idx, op.kind, op.mb_idx, op.peer)] = done
    return out


@pytest.mark.parametrize("graph, name", PAIRS, ids=[f"{g}-{n}" for g, n in PAIRS])
def test_every_receive_is_posted_no_later_than_in_place_and_the_compute_order_is_the_same(graph, name):
    early, in_place = _programs(GRAPHS[graph], name)
    for r in early.actions:
        assert _compute(early.actions[r]) == _compute(in_place.actions[r])
        before, after = _posted_before(early.actions[r]), _posted_before(in_place.actions[r])
        assert before.keys() == after.keys()
        assert all(before[k] <= after[k] for k in before)
        assert any(a.kind.spec.completes for a in early.actions[r] if r in early.actions)


@pytest.mark.parametrize("graph, name", PAIRS, ids=[f"{g}-{n}" for g, n in PAIRS])
def test_posting_early_is_never_slower_and_hides_a_late_receives_extra_exchange(graph, name):
    early, in_place = _programs(GRAPHS[graph], name)
    rank_of = early.fold.rank_of if early.fold else None

    def makespan(p, **link):
        return simulate(p.actions, rank_of=rank_of, **link).makespan
    assert makespan(early) <= makespan(in_place)
    link = {"latency": 0.05, "late_receive": 0.1}   # in units of a forward
    assert makespan(early, **link) < makespan(in_place, **link)
    for mode in ("async", "rendezvous"):
        simulate(early.actions, mode=mode, rank_of=rank_of)


def test_a_receive_posted_early_completes_at_its_wait_and_its_latency_overlaps_the_compute_before():
    # Stage 1 posts micro-batch 1's activations before the backward of micro-batch 0 (2.5..4.5): the
    # message, sent at 2, is through at 3 and the forward starts as the backward ends. Received in
    # place after the backward, it pays the latency and a late receive's extra exchange on top.
    sender = [Action.parse(t) for t in "0F0 0SEND_F0@1 0F1 0SEND_F1@1".split()]
    early = {0: sender, 1: [Action.parse(t) for t in "1RECV_F0@0 1WAIT_F0 1F0 1RECV_F1@0 1B0 1WAIT_F1 1F1".split()]}
    in_place = {0: sender, 1: [Action.parse(t) for t in "1RECV_F0@0 1F0 1B0 1RECV_F1@0 1F1".split()]}
    link = {"latency": 0.5, "late_receive": 0.25}
    spans = {str(a): (start, end) for a, start, end in simulate(early, **link).spans[1]}
    assert spans["1B0"] == (2.5, 4.5) and spans["1WAIT_F1"] == (4.5, 4.5) and spans["1F1"] == (4.5, 5.5)
    late = {str(a): (start, end) for a, start, end in simulate(in_place, **link).spans[1]}
    assert late["1F1"] == (5.25, 6.25)


@pytest.mark.parametrize("text, message", [
    ("1LOAD0 1WAIT_F0 1RECV_F0@0 1F0", "1RECV_F0@0 is posted after 1WAIT_F0"),
    ("1LOAD0 1RECV_F0@0 1F0 1WAIT_F0", "1F0 runs before 1WAIT_F0"),
    ("1LOAD0 1RECV_F0@0 1WAIT_B0 1F0", "1WAIT_B0 completes no receive posted before it"),
])
def test_the_validator_refuses_a_wait_out_of_place_naming_it(text, message):
    lists = {0: [Action.parse(t) for t in "0LOAD0 0F0 0SEND_F0@1".split()], 1: [Action.parse(t) for t in text.split()]}
    with pytest.raises(ScheduleError, match=message):
        check_lists(lists, StageGraph.chain(2), 1, train=False, releases=False)
