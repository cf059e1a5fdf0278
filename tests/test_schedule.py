"""Unit tests of the schedule IR, generators, validator and simulator: pure, CPU-only.

DeepSpeed's own ``TrainSchedule`` (a pure generator, no process group needed) is the reference
for the 1F1B compute order on a chain.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpp_deepspeed.errors import GPPConfigError, ScheduleError
from gpp_deepspeed.graph import StageEdge, StageGraph
from gpp_deepspeed.schedule import (SCHEDULES, Action, ActionKind, add_release, add_send_recv, assign_buffers, build_schedule,
                                    merge_backward,
                                    format_schedule, get_schedule, gpipe, group_for_rendezvous, group_p2p, num_slots,
                                    one_f_one_b,
                                    order_transfers, simulate, validate_schedule, warmup_forwards)
from gpp_deepspeed.schedule import build_program, validate_async, validate_program
from liveness import check_slots

K = ActionKind
# One stage per rank (programs keyed by stage); the folded ones are tests/test_virtual_stages.py's.
SYNC_SCHEDULES = [name for name, spec in SCHEDULES.items() if not spec.asynchronous and spec.folded is None]


def dag(num_stages: int, edges) -> StageGraph:
    return StageGraph(num_stages=num_stages, edges=tuple(StageEdge(a, b, ()) for a, b in edges),
                      output_stage=num_stages - 1)


def parse_schedule(lines: dict[int, str]) -> dict[int, list[Action]]:
    return {s: [Action.parse(t) for t in text.split()] for s, text in lines.items()}


def modulo_slots(num_buffers: dict[int, int], num_mb: int = 16) -> dict[int, dict[int, int]]:
    """Micro-batch ``j`` of stage ``s`` in buffer ``j % num_buffers[s]`` (DeepSpeed's rule)."""
    return {s: {j: j % n for j in range(num_mb)} for s, n in num_buffers.items()}


def compute_order(actions):
    """(kind, micro-batch) of the F and B actions, in program order."""
    return [(a.kind.value, a.mb_idx) for a in actions if a.kind in (K.FORWARD, K.BACKWARD)]


# ---------------------------------------------------------------------------------------------
# (a) Action strings


def example_action(kind: ActionKind, stage: int, mb: int, peer: int) -> Action:
    if kind is K.P2P:  # a send and a receive to the same peer, posted together
        return Action.group([Action(stage, K.SEND_F, mb, peer), Action(stage, K.RECV_B, max(mb - 1, 0), peer)])
    return Action(stage, kind, mb if kind.has_mb else None, peer if kind.takes_peer else None)


@settings(max_examples=200, deadline=None)
@given(kind=st.sampled_from(list(ActionKind)), stage=st.integers(0, 999), mb=st.integers(0, 9999),
       peer=st.integers(0, 999))
def test_action_parse_inverts_str_for_every_kind(kind, stage, mb, peer):
    a = example_action(kind, stage, mb, peer)
    assert Action.parse(str(a)) == a


def test_action_str_matches_hand_written_forms():
    assert str(Action(2, K.FORWARD, 0)) == "2F0"
    assert str(Action(0, K.BACKWARD, 13)) == "0B13"
    assert str(Action(0, K.LOAD, 4)) == "0LOAD4"
    assert str(Action(1, K.SEND_F, 1, peer=3)) == "1SEND_F1@3"
    assert str(Action(3, K.RECV_B, 0, peer=12)) == "3RECV_B0@12"
    assert str(Action(5, K.REDUCE_TIED)) == "5REDUCE_TIED"
    assert str(Action(5, K.WAIT_SENDS)) == "5WAIT_SENDS"


def test_action_parse_reads_torch_compatible_compute_form():
    assert Action.parse("2F0") == Action(2, K.FORWARD, 0)
    assert Action.parse("10B7") == Action(10, K.BACKWARD, 7)
    assert Action.parse(" 0STEP ") == Action(0, K.STEP)


def test_action_parse_reads_torch_compatible_send_form_without_peer():
    a = Action.parse("1SEND_F1")
    assert (a.stage_idx, a.kind, a.mb_idx) == (1, K.SEND_F, 1)
    assert a.peer == 2  # on a chain, SEND_F goes to the next stage


@pytest.mark.parametrize("bad", ["F0", "0X0", "0F", "0SEND_F0@", "0F0@1", "0STEP1", "0SEND_B0", "-1F0", ""])
def test_action_parse_rejects_malformed_or_inconsistent_strings(bad):
    with pytest.raises(ScheduleError):
        Action.parse(bad)


def test_action_constructor_checks_micro_batch_and_peer_presence():
    with pytest.raises(ScheduleError, match="micro-batch"):
        Action(0, K.FORWARD)
    with pytest.raises(ScheduleError, match="peer"):
        Action(0, K.RECV_F, 0)
    with pytest.raises(ScheduleError, match="peer"):
        Action(0, K.FORWARD, 0, peer=1)


def test_action_str_and_parse_of_grouped_transfers_and_releases():
    g = Action.parse("(1SEND_F1@2;1RECV_B0@2)P2P")
    assert g.kind is K.P2P and g.stage_idx == 1 and g.ops == (Action(1, K.SEND_F, 1, peer=2),
                                                               Action(1, K.RECV_B, 0, peer=2))
    assert g.transfers == g.ops and g.mb_idxs == (1, 0)
    # inside a group, torch's chain form without a peer still means the neighbour
    assert Action.parse("(1SEND_F1;1RECV_B0)P2P") == g
    assert str(Action(3, K.RELEASE_IN, 2)) == "3RELEASE_IN2" and Action.parse("3RELEASE_OUT2").kind is K.RELEASE_OUT


@pytest.mark.parametrize("bad", ["(1SEND_F1@2)P2P", "(1F1;1RECV_B0@2)P2P", "1P2P",
                                 "(1SEND_F1@2;1RECV_B0@2)", "1RELEASE_IN"])
def test_action_parse_rejects_malformed_groups_and_releases(bad):
    with pytest.raises(ScheduleError):
        Action.parse(bad)


def test_a_group_may_hold_several_stages_transfers_but_a_stage_program_refuses_another_stages():
    # A rank holding stages 1 and 2 posts their transfers together; a program of one stage per
    # rank must not: the validator names the stranger.
    group = Action.parse("(1SEND_F1@2;2RECV_B0@1)P2P")
    assert Action.parse(str(group)) == group
    program = build_program(StageGraph.chain(3), 2, schedule="1f1b")
    actions = {**program.actions, 1: [group, *program.actions[1]]}
    with pytest.raises(ScheduleError, match="stage 1 slot 0 holds 2RECV_B0@1, an action of stage 2"):
        validate_schedule(actions, StageGraph.chain(3), 2, train=True)


def test_format_schedule_prints_one_line_per_stage():
    text = format_schedule(one_f_one_b(StageGraph.chain(2), 2))
    assert text == "stage 0: 0F0 0F1 0B0 0B1\nstage 1: 1F0 1B0 1F1 1B1"


# ---------------------------------------------------------------------------------------------
# (b) warm-up forwards


@pytest.mark.parametrize("num_stages", range(1, 7))
@pytest.mark.parametrize("num_mb", [1, 2, 3, 8])
def test_warmup_forwards_on_a_chain_is_stages_left_capped_by_micro_batches(num_stages, num_mb):
    sg = StageGraph.chain(num_stages)
    for i in range(num_stages):
        expected = min(num_stages - 1 - i, num_mb)
        assert warmup_forwards(sg, i, num_mb) == expected
        order = compute_order(one_f_one_b(sg, num_mb)[i])
        first_b = next(k for k, (kind, _) in enumerate(order) if kind == "B")
        # forwards before the first backward: the warm-up, plus the one that the first backward pairs with
        assert first_b == min(expected + 1, num_mb)


def test_warmup_forwards_of_two_branches_into_a_merge():
    sg = dag(3, [(0, 2), (1, 2)])
    assert [sg.depth(s) for s in range(3)] == [2, 2, 1]
    assert [warmup_forwards(sg, s, 4) for s in range(3)] == [1, 1, 0]
    assert [warmup_forwards(sg, s, 1) for s in range(3)] == [1, 1, 0]
    sched = one_f_one_b(sg, 3)
    assert [str(a) for a in sched[0]] == ["0F0", "0F1", "0B0", "0F2", "0B1", "0B2"]
    assert [str(a) for a in sched[2]] == ["2F0", "2B0", "2F1", "2B1", "2F2", "2B2"]


def test_warmup_forwards_follow_the_longest_path_not_the_stage_index():
    # 0 -> 2 -> 3 and 1 -> 3: stage 1 is close to the output although its index is low
    sg = dag(4, [(0, 2), (2, 3), (1, 3)])
    assert [warmup_forwards(sg, s, 8) for s in range(4)] == [2, 1, 1, 0]


# ---------------------------------------------------------------------------------------------
# (c) DeepSpeed's TrainSchedule as the reference for a chain


def deepspeed_compute_order(num_mb: int, num_stages: int, stage_id: int):
    from deepspeed.runtime.pipe.schedule import BackwardPass, ForwardPass, TrainSchedule

    order, n_fwd, n_bwd = [], 0, 0
    for cmds in TrainSchedule(micro_batches=num_mb, stages=num_stages, stage_id=stage_id).steps():
        for cmd in cmds:
            # the k-th ForwardPass (BackwardPass) of a stage is micro-batch k
            if isinstance(cmd, ForwardPass):
                order.append(("F", n_fwd))
                n_fwd += 1
            elif isinstance(cmd, BackwardPass):
                order.append(("B", n_bwd))
                n_bwd += 1
    return order


@pytest.mark.parametrize("num_stages", range(1, 6))
def test_one_f_one_b_on_a_chain_matches_deepspeed_train_schedule(num_stages):
    sg = StageGraph.chain(num_stages)
    for num_mb in range(1, 9):
        ours = one_f_one_b(sg, num_mb)
        for i in range(num_stages):
            assert compute_order(ours[i]) == deepspeed_compute_order(num_mb, num_stages, i), (num_stages, num_mb, i)


# ---------------------------------------------------------------------------------------------
# (d) every generated schedule on random stage DAGs is valid


@st.composite
def stage_dags(draw):
    """S stages, edges only from lower to higher index, every stage but S-1 has a successor."""
    n = draw(st.integers(1, 7))
    edges = set()
    for s in range(n - 1):
        succs = draw(st.lists(st.integers(s + 1, n - 1), min_size=1, max_size=3, unique=True))
        edges.update((s, t) for t in succs)
    return dag(n, sorted(edges))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sg=stage_dags(), num_mb=st.integers(1, 6))
def test_build_schedule_on_random_stage_dags_passes_the_rendezvous_validator(sg, num_mb):
    n = sg.num_stages
    for name in SYNC_SCHEDULES:
        for train in (True, False):
            program = build_program(sg, num_mb, schedule=name, train=train)
            sched, slots = program.actions, program.slots
            check_slots(sched, slots)   # the slots against live ranges read from the program's text
            # rendezvous mode: every send blocks until its receive is posted (NCCL)
            timeline = validate_schedule(sched, sg, num_mb, train=train)
            assert simulate(sched, mode="async").makespan <= timeline.makespan
            # compute time alone bounds the makespan from below (split: I and W of one unit each)
            per_mb = 3.0 if train else 1.0
            assert timeline.makespan >= num_mb * per_mb
            for s in range(n):
                kinds = [a.kind for a in sched[s]]
                assert kinds.count(K.FORWARD) == num_mb
                split = kinds.count(K.BACKWARD_INPUT)
                assert kinds.count(K.BACKWARD) + split == (num_mb if train else 0)
                assert kinds.count(K.BACKWARD_WEIGHT) == split
                assert kinds.count(K.RELEASE_IN) == kinds.count(K.RELEASE_OUT) == num_mb
                assert kinds[-1] is (K.STEP if train else K.WAIT_SENDS)
                assert num_slots(slots[s]) <= num_mb
            # dynamic shapes: every activation's layout in an earlier action, still deadlock-free
            validate_program(build_program(sg, num_mb, schedule=name, train=train, layouts=True), sg)


@pytest.mark.parametrize("num_stages", range(1, 6))
@pytest.mark.parametrize("num_mb", [1, 2, 3, 8])
def test_one_f_one_b_on_a_chain_needs_one_buffer_more_than_its_depth_at_most(num_stages, num_mb):
    # depth micro-batches in flight, plus the one whose gradient goes out while the next comes in
    sg = StageGraph.chain(num_stages)
    slots = assign_buffers(build_schedule(sg, num_mb))
    for s in range(num_stages):
        assert num_slots(slots[s]) <= min(num_mb, sg.depth(s) + 1)


def test_build_schedule_lowers_a_two_branch_graph_as_written_by_hand():
    sg = dag(3, [(0, 2), (1, 2)])
    sched = build_program(sg, 2, schedule="1f1b", early=False).actions   # receives in place
    expected = {
        0: "0LOAD0 0F0 0SEND_F0@2 0LOAD1 0F1 (0SEND_F1@2;0RECV_B0@2)P2P 0B0 0RELEASE_OUT0 0RELEASE_IN0 "
           "0RECV_B1@2 0B1 0RELEASE_OUT1 0RELEASE_IN1 0WAIT_SENDS 0REDUCE_TIED 0REDUCE_GRAD 0STEP",
        1: "1LOAD0 1F0 1SEND_F0@2 1LOAD1 1F1 (1SEND_F1@2;1RECV_B0@2)P2P 1B0 1RELEASE_OUT0 1RELEASE_IN0 "
           "1RECV_B1@2 1B1 1RELEASE_OUT1 1RELEASE_IN1 1WAIT_SENDS 1REDUCE_TIED 1REDUCE_GRAD 1STEP",
        2: "2LOAD0 (2RECV_F0@0;2RECV_F0@1)P2P 2F0 2B0 2RELEASE_OUT0 "
           "(2SEND_B0@0;2SEND_B0@1;2RECV_F1@0;2RECV_F1@1)P2P 2RELEASE_IN0 2LOAD1 2F1 2B1 2RELEASE_OUT1 "
           "(2SEND_B1@0;2SEND_B1@1)P2P 2RELEASE_IN1 2WAIT_SENDS 2REDUCE_TIED 2REDUCE_GRAD 2STEP",
    }
    assert sched == parse_schedule(expected)


def test_build_schedule_rejects_an_unknown_name_and_zero_micro_batches():
    with pytest.raises(GPPConfigError, match="chimera") as info:
        build_schedule(StageGraph.chain(2), 2, name="chimera")
    assert "1f1b" in str(info.value) and "gpipe" in str(info.value)
    with pytest.raises(GPPConfigError):
        build_schedule(StageGraph.chain(2), 0)
    assert get_schedule("GPipe").generator is gpipe


# ---------------------------------------------------------------------------------------------
# (e) the validator catches broken schedules


CHAIN2_M1 = {
    0: "0LOAD0 0F0 0SEND_F0@1 0RECV_B0@1 0B0 0WAIT_SENDS",
    1: "1LOAD0 1RECV_F0@0 1F0 1B0 1SEND_B0@0 1WAIT_SENDS",
}

CHAIN2_M2 = {
    0: "0LOAD0 0F0 0SEND_F0@1 0LOAD1 0F1 0SEND_F1@1 0RECV_B0@1 0B0 0RECV_B1@1 0B1 0WAIT_SENDS",
    1: "1LOAD0 1RECV_F0@0 1F0 1B0 1SEND_B0@0 1LOAD1 1RECV_F1@0 1F1 1B1 1SEND_B1@0 1WAIT_SENDS",
}


# CHAIN2_M2 with the transfers that cross grouped, as torch's 1F1B posts them with batch_isend_irecv
CHAIN2_M2_GROUPED = {
    0: "0LOAD0 0F0 0SEND_F0@1 0LOAD1 0F1 (0SEND_F1@1;0RECV_B0@1)P2P 0B0 0RECV_B1@1 0B1 0WAIT_SENDS",
    1: "1LOAD0 1RECV_F0@0 1F0 1B0 (1SEND_B0@0;1RECV_F1@0)P2P 1LOAD1 1F1 1B1 1SEND_B1@0 1WAIT_SENDS",
}


def test_validate_schedule_accepts_the_hand_written_chain_schedules():
    validate_schedule(parse_schedule(CHAIN2_M1), StageGraph.chain(2), 1, train=True, releases=False)
    validate_schedule(parse_schedule(CHAIN2_M2), StageGraph.chain(2), 2, train=True,
                      slots=modulo_slots({0: 2, 1: 1}), mode="async", releases=False)
    validate_schedule(parse_schedule(CHAIN2_M2_GROUPED), StageGraph.chain(2), 2, train=True,
                      slots=modulo_slots({0: 2, 1: 2}), releases=False)


def test_validate_schedule_rejects_two_stages_that_each_send_to_the_other_before_receiving():
    # gloo buffers both sends, so the ungrouped schedule runs there; under NCCL each send waits for
    # its receive, which the other stage posts only after its own send: both wait forever
    simulate(parse_schedule(CHAIN2_M2), mode="async")
    with pytest.raises(ScheduleError, match="deadlocks under rendezvous semantics") as info:
        validate_schedule(parse_schedule(CHAIN2_M2), StageGraph.chain(2), 2, train=True, releases=False)
    msg = str(info.value)
    assert "stage 0 at 0SEND_F1@1" in msg and "stage 1 at 1SEND_B0@0" in msg
    assert "0SEND_F1@1 waits for stage 1 to post its receive" in msg and "batch_isend_irecv" in msg


def test_validate_schedule_runs_a_grouped_transfer_as_one_step_whose_ops_progress_together():
    timeline = simulate(parse_schedule(CHAIN2_M2_GROUPED), mode="rendezvous")
    spans = {str(a): (start, end) for a, start, end in timeline.spans[0]}
    # stage 0 posts F1's send and B0's receive together (t = 2); both are through when stage 1
    # posts its own group, after F0 (t = 1..2) and B0 (t = 2..4)
    assert spans["(0SEND_F1@1;0RECV_B0@1)P2P"] == (4.0, 4.0)


def test_simulate_rejects_an_unknown_mode():
    with pytest.raises(ScheduleError, match="rendezvous"):
        simulate(parse_schedule(CHAIN2_M1), mode="nccl")


def test_validate_schedule_reports_a_deadlock_when_a_gradient_is_awaited_before_the_activation_is_sent():
    broken = {**CHAIN2_M1, 0: "0LOAD0 0F0 0RECV_B0@1 0SEND_F0@1 0B0 0WAIT_SENDS"}
    with pytest.raises(ScheduleError, match="deadlock") as info:
        validate_schedule(parse_schedule(broken), StageGraph.chain(2), 1, train=True, releases=False)
    msg = str(info.value)
    assert "0RECV_B0@1" in msg and "1RECV_F0@0" in msg


def test_validate_schedule_reports_a_missing_backward():
    broken = {**CHAIN2_M1, 1: "1LOAD0 1RECV_F0@0 1F0 1SEND_B0@0 1WAIT_SENDS"}
    with pytest.raises(ScheduleError, match="never runs 1B0"):
        validate_schedule(parse_schedule(broken), StageGraph.chain(2), 1, train=True, releases=False)


def test_validate_schedule_reports_a_forward_before_its_receive():
    broken = {**CHAIN2_M1, 1: "1LOAD0 1F0 1RECV_F0@0 1B0 1SEND_B0@0 1WAIT_SENDS"}
    with pytest.raises(ScheduleError, match="before receiving") as info:
        validate_schedule(parse_schedule(broken), StageGraph.chain(2), 1, train=True, releases=False)
    assert "stage 0" in str(info.value)


def test_validate_schedule_reports_a_backward_before_its_gradient_arrives():
    broken = {**CHAIN2_M1, 0: "0LOAD0 0F0 0SEND_F0@1 0B0 0RECV_B0@1 0WAIT_SENDS"}
    with pytest.raises(ScheduleError, match="before receiving its gradient"):
        validate_schedule(parse_schedule(broken), StageGraph.chain(2), 1, train=True, releases=False)


def test_validate_schedule_reports_a_send_to_a_stage_that_is_not_a_neighbour():
    good = {
        0: "0LOAD0 0F0 0SEND_F0@1",
        1: "1RECV_F0@0 1F0 1SEND_F0@2",
        2: "2LOAD0 2RECV_F0@1 2F0",
    }
    validate_schedule(parse_schedule(good), StageGraph.chain(3), 1, train=False, releases=False)
    broken = {**good, 0: "0LOAD0 0F0 0SEND_F0@1 0SEND_F0@2"}
    with pytest.raises(ScheduleError, match="not a successor") as info:
        validate_schedule(parse_schedule(broken), StageGraph.chain(3), 1, train=False, releases=False)
    assert "0SEND_F0@2" in str(info.value)


def test_validate_schedule_reports_two_micro_batches_sharing_a_buffer_in_flight():
    # stage 0 holds micro-batches 0 and 1 at once (F1 runs before B0), so one buffer is too few
    with pytest.raises(ScheduleError, match="share buffer 0"):
        validate_schedule(parse_schedule(CHAIN2_M2), StageGraph.chain(2), 2, train=True,
                          slots=modulo_slots({0: 1}), mode="async", releases=False)
    # stage 1 finishes micro-batch 0 before touching micro-batch 1, so one buffer is enough there...
    validate_schedule(parse_schedule(CHAIN2_M2), StageGraph.chain(2), 2, train=True,
                      slots=modulo_slots({0: 2, 1: 1}), mode="async", releases=False)
    # ...unless it sends the gradient of 0 while receiving 1, in one grouped transfer
    with pytest.raises(ScheduleError, match="stage 1: micro-batches 0 and 1 share buffer 0"):
        validate_schedule(parse_schedule(CHAIN2_M2_GROUPED), StageGraph.chain(2), 2, train=True,
                          slots=modulo_slots({0: 2, 1: 1}), releases=False)


def test_validate_schedule_reports_messages_received_in_another_order_than_sent():
    broken = {**CHAIN2_M2,
              1: "1LOAD1 1RECV_F1@0 1F1 1B1 1SEND_B1@0 1LOAD0 1RECV_F0@0 1F0 1B0 1SEND_B0@0 1WAIT_SENDS"}
    with pytest.raises(ScheduleError, match="carries micro-batch 0"):
        validate_schedule(parse_schedule(broken), StageGraph.chain(2), 2, train=True, releases=False)


def test_validate_schedule_reports_a_missing_stage_and_a_foreign_action():
    with pytest.raises(ScheduleError, match="expected 0..1"):
        validate_schedule(parse_schedule({0: CHAIN2_M1[0]}), StageGraph.chain(2), 1, train=True, releases=False)
    broken = {**CHAIN2_M1, 0: "0LOAD0 0F0 0SEND_F0@1 1STEP 0RECV_B0@1 0B0 0WAIT_SENDS"}
    with pytest.raises(ScheduleError, match="an action of stage 1"):
        validate_schedule(parse_schedule(broken), StageGraph.chain(2), 1, train=True, releases=False)


def test_validate_schedule_rejects_gpipe_with_fewer_buffers_than_micro_batches():
    sg = StageGraph.chain(3)
    sched = build_schedule(sg, 4, name="gpipe")
    validate_schedule(sched, sg, 4, train=True, slots=modulo_slots({s: 4 for s in range(3)}))
    with pytest.raises(ScheduleError, match="share buffer"):
        validate_schedule(sched, sg, 4, train=True, slots=modulo_slots({s: 3 for s in range(3)}))


# ---------------------------------------------------------------------------------------------
# (f) simulated makespan


@pytest.mark.parametrize("num_stages", [1, 2, 3, 5])
@pytest.mark.parametrize("num_mb", [1, 2, 4, 7])
@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
def test_simulate_chain_makespan_is_stages_plus_micro_batches_minus_one_rounds(num_stages, num_mb, name):
    # tf = 1, tb = 2 (default_duration): (S - 1 + M) * (tf + tb), the textbook pipeline makespan
    sched = build_schedule(StageGraph.chain(num_stages), num_mb, name=name)
    assert simulate(sched).makespan == (num_stages - 1 + num_mb) * 3


@pytest.mark.parametrize("num_mb", [1, 2, 4, 8])
def test_simulate_four_branches_into_a_merge_beat_a_five_stage_chain(num_mb):
    branches = dag(5, [(0, 4), (1, 4), (2, 4), (3, 4)])
    graph_span = simulate(build_schedule(branches, num_mb)).makespan
    chain_span = simulate(build_schedule(StageGraph.chain(5), num_mb)).makespan
    assert graph_span < chain_span
    # the graph pipeline has depth 2, so it runs like a two-stage chain
    assert graph_span == (2 - 1 + num_mb) * 3


def test_simulate_charges_latency_once_per_hop():
    sched = build_schedule(StageGraph.chain(2), 1, name="1f1b", train=False)
    # forward on stage 0 (1), one hop (0.5), forward on stage 1 (1)
    assert simulate(sched, latency=0.5).makespan == 2.5


# ---------------------------------------------------------------------------------------------
# (g) lowering passes on literal action lists


def lists(text: str) -> list[Action]:
    return [Action.parse(t) for t in text.split()]


def test_group_p2p_merges_each_run_of_transfers_and_moves_loads_and_releases_after_it():
    before = {1: lists("1RECV_F0@0 1F0 1SEND_F0@2 1RECV_F1@0 1F1 1SEND_F1@2 1RECV_B0@2 1B0 1RELEASE_OUT0 "
                       "1SEND_B0@0 1RELEASE_IN0 1LOAD2 1RECV_F2@0 1F2 1WAIT_SENDS")}
    after = {1: lists("1RECV_F0@0 1F0 (1SEND_F0@2;1RECV_F1@0)P2P 1F1 (1SEND_F1@2;1RECV_B0@2)P2P 1B0 1RELEASE_OUT0 "
                      "(1SEND_B0@0;1RECV_F2@0)P2P 1RELEASE_IN0 1LOAD2 1F2 1WAIT_SENDS")}
    assert group_p2p(before) == after


def test_merge_backward_fuses_i_and_w_only_on_stages_that_send_no_gradient_back():
    # 0 -> 2 carries no gradient (a frozen tower's output), 1 -> 2 does: stage 0 and stage 1 read
    # only the batch, stage 2 sends a gradient to stage 1 only, so only stage 2 keeps its split
    sg = StageGraph(num_stages=4, edges=(StageEdge(0, 2, (), grad=False), StageEdge(1, 2, ()), StageEdge(2, 3, ())),
                    output_stage=3)
    before = {0: lists("0F0 0F1 0F2"),
              1: lists("1F0 1F1 1RECV_B0@2 1I0 1F2 1RECV_B1@2 1I1 1W0 1RECV_B2@2 1I2 1W1 1W2"),
              2: lists("2RECV_F0@1 2F0 2RECV_B0@3 2I0 2SEND_B0@1 2W0"),
              3: lists("3RECV_F0@2 3F0 3I0 3SEND_B0@2 3W0")}
    after = {0: lists("0F0 0F1 0F2"),
             1: lists("1F0 1F1 1RECV_B0@2 1F2 1RECV_B1@2 1B0 1RECV_B2@2 1B1 1B2"),
             2: lists("2RECV_F0@1 2F0 2RECV_B0@3 2I0 2SEND_B0@1 2W0"),
             3: lists("3RECV_F0@2 3F0 3I0 3SEND_B0@2 3W0")}
    assert merge_backward(before, sg) == after
    # so every zero-bubble program runs B where nothing goes back, and frees as B does (no RELEASE_W)
    for name in ("zb1", "zb2"):
        program = build_schedule(sg, 3, name=name)
        for s, expect in ((1, {"B"}), (2, {"I", "W"}), (3, {"I", "W"})):
            assert {a.kind.value for a in program[s] if a.kind.spec.backward} == expect, (name, s)
        assert not any(a.kind is K.RELEASE_W for a in program[1])


def test_add_release_frees_outputs_after_the_backward_and_inputs_after_the_gradient_is_sent():
    before = {1: lists("1RECV_F0@0 1F0 (1SEND_F0@2;1RECV_F1@0)P2P 1F1 (1SEND_F1@2;1RECV_B0@2)P2P 1B0 "
                       "(1SEND_B0@0;1RECV_B1@2)P2P 1B1 1SEND_B1@0")}
    after = {1: lists("1RECV_F0@0 1F0 (1SEND_F0@2;1RECV_F1@0)P2P 1F1 (1SEND_F1@2;1RECV_B0@2)P2P 1B0 1RELEASE_OUT0 "
                      "(1SEND_B0@0;1RECV_B1@2)P2P 1RELEASE_IN0 1B1 1RELEASE_OUT1 1SEND_B1@0 1RELEASE_IN1")}
    assert add_release(before) == after


def test_add_release_in_evaluation_frees_inputs_after_the_forward_and_outputs_after_their_sends():
    before = {0: lists("0LOAD0 0F0 0SEND_F0@1 0SEND_F0@2 0LOAD1 0F1 0SEND_F1@1 0SEND_F1@2")}
    after = {0: lists("0LOAD0 0F0 0RELEASE_IN0 0SEND_F0@1 0SEND_F0@2 0RELEASE_OUT0 "
                      "0LOAD1 0F1 0RELEASE_IN1 0SEND_F1@1 0SEND_F1@2 0RELEASE_OUT1")}
    assert add_release(before) == after


def test_the_liveness_oracle_refuses_two_live_micro_batches_in_one_slot_and_a_slot_too_many():
    together = {0: lists("0F0 0F1 0B0 0RELEASE_OUT0 0B1 0RELEASE_OUT1")}
    check_slots(together, {0: {0: 0, 1: 1}})
    with pytest.raises(AssertionError, match="micro-batches 0 and 1 live together in slot 0"):
        check_slots(together, {0: {0: 0, 1: 0}})
    one_after_the_other = {1: lists("1RECV_F0@0 1F0 1B0 1RELEASE_OUT0 (1SEND_B0@0;1RECV_F1@0)P2P 1F1")}
    with pytest.raises(AssertionError, match="live together"):   # the group sends 0's gradient, receives 1
        check_slots(one_after_the_other, {1: {0: 0, 1: 0}})
    with pytest.raises(AssertionError):
        check_slots({0: lists("0F0 0B0 0F1 0B1")}, {0: {0: 0, 1: 1}})


def test_assign_buffers_reuses_a_slot_once_its_micro_batch_is_released():
    sched = {1: lists("1RECV_F0@0 1F0 1RECV_F1@0 1F1 1B0 1RELEASE_OUT0 (1SEND_B0@0;1RECV_F2@0)P2P 1RELEASE_IN0 "
                      "1F2 1B1 1RELEASE_OUT1 1RELEASE_IN1 1B2 1RELEASE_OUT2 1RELEASE_IN2")}
    # 0 and 1 are live together; 2 arrives in the group that returns 0's gradient, so 0's slot is
    # still held; 1's slot is free by the time nothing else is live
    assert assign_buffers(sched) == {1: {0: 0, 1: 1, 2: 2}}
    sched = {0: lists("0F0 0F1 0B0 0RELEASE_IN0 0F2 0B1 0RELEASE_IN1 0F3 0B2 0B3")}
    assert assign_buffers(sched) == {0: {0: 0, 1: 1, 2: 0, 3: 1}}
    assert num_slots({0: 0, 1: 1, 2: 0}) == 2 and num_slots({}) == 1


def test_group_for_rendezvous_keeps_a_chain_as_written_and_reorders_only_what_would_deadlock():
    chain = StageGraph.chain(4)
    plain = add_send_recv(one_f_one_b(chain, 6), chain)
    assert group_for_rendezvous(plain) == group_p2p(plain)
    # a chain 0 -> 1 -> 2 -> 3 with a skip edge 0 -> 3 between stages 3 warm-up forwards apart
    skip = dag(4, [(0, 1), (0, 2), (0, 3), (1, 2), (2, 3)])
    plain = add_send_recv(one_f_one_b(skip, 4), skip)
    with pytest.raises(ScheduleError, match="rendezvous"):
        simulate(group_p2p(plain), mode="rendezvous")
    assert group_for_rendezvous(plain) == group_p2p(order_transfers(plain))


def test_order_transfers_sends_on_a_skip_edge_when_the_receiver_is_ready():
    # 0 -> 1 -> 2 with a skip edge 0 -> 2, 1F1B, 3 micro-batches: stage 0 runs two warm-up
    # forwards, stage 2 none, so stage 2 returns gradient 0 before it can take activation 1
    sg = dag(3, [(0, 1), (0, 2), (1, 2)])
    plain = add_send_recv(one_f_one_b(sg, 3), sg)
    assert [str(a) for a in plain[0][:9]] == ["0F0", "0SEND_F0@1", "0SEND_F0@2", "0F1", "0SEND_F1@1",
                                              "0SEND_F1@2", "0F2", "0SEND_F2@1", "0SEND_F2@2"]
    with pytest.raises(ScheduleError, match="rendezvous"):
        simulate(plain, mode="rendezvous")
    ordered = order_transfers(plain)
    # activation 2 goes to stage 2 with the receive of gradient 0, which stage 2 returns first
    assert ordered[0] == lists("0F0 0SEND_F0@1 0SEND_F0@2 0F1 0SEND_F1@1 0SEND_F1@2 0F2 0SEND_F2@1 0RECV_B0@1 "
                               "0RECV_B0@2 0SEND_F2@2 0B0 0RECV_B1@1 0RECV_B1@2 0B1 0RECV_B2@1 0RECV_B2@2 0B2")
    # and stage 2 takes activation 1 before returning gradient 0, as stage 0 sends them
    assert ordered[2][4:8] == lists("2RECV_F1@0 2RECV_F1@1 2SEND_B0@1 2SEND_B0@0")
    for s in range(3):
        assert compute_order(ordered[s]) == compute_order(plain[s])
    simulate(ordered, mode="rendezvous")
    assert simulate(ordered, mode="async").makespan == simulate(plain, mode="async").makespan


def test_frozen_stages_run_no_backward_and_their_edges_carry_no_gradient():
    from gpp_deepspeed.graph import build_layer_graph
    from gpp_deepspeed.graph.stages import derive_partition, mark_gradient_flow
    graph = build_layer_graph(["img", "txt"], [("vis", ["img"]), ("proj", ["vis"]), ("text", ["txt"]),
                                               ("head", ["proj", "text"])])
    part = derive_partition(graph, {"vis": 0, "proj": 1, "text": 2, "head": 3}, num_stages=4)
    frozen = mark_gradient_flow(part, trainable={"text", "head"}).stage_graph
    assert frozen.frozen == {0, 1} and {(e.src, e.dst): e.grad for e in frozen.edges} == {
        (0, 1): False, (1, 3): False, (2, 3): True}
    schedule = build_schedule(frozen, 4)
    validate_schedule(schedule, frozen, 4, train=True)
    kinds = {s: {(op.kind, op.peer) for a in actions for op in (a.ops or (a, ))} for s, actions in schedule.items()}
    backward = {ActionKind.BACKWARD, ActionKind.SEND_B, ActionKind.RECV_B}
    assert not {k for k, _ in kinds[0] | kinds[1]} & backward
    assert (ActionKind.SEND_B, 1) not in kinds[3] and (ActionKind.SEND_B, 2) in kinds[3]
    assert (ActionKind.BACKWARD, None) in kinds[2]
    # The validator refuses a backward on a frozen stage and a gradient on an edge without one.
    with pytest.raises(ScheduleError, match="carries no gradient|is frozen"):
        validate_schedule(build_schedule(part.stage_graph, 4), frozen, 4, train=True)
    # A projection trained after a frozen encoder: the encoder's stage is frozen, the edge too.
    half = mark_gradient_flow(part, trainable={"proj", "text", "head"}).stage_graph
    assert half.frozen == {0} and [e.grad for e in half.edges] == [False, True, True]


def test_a_middle_stage_that_reads_a_graph_input_loads_the_batch_in_every_program_and_in_the_simulator():
    # x -> px (stage 0) -> mix (stage 1, which also reads y) -> head (stage 2)
    from costdbs import synthetic_db
    from gpp_deepspeed.graph import build_layer_graph
    from gpp_deepspeed.graph.stages import derive_partition
    from gpp_deepspeed.planner.plan import Plan, PlanStage
    from gpp_deepspeed.planner.simulate import simulate_plan
    from gpp_deepspeed.schedule import AsyncProgram, ProgramFactory, build_program, steady_batch_idx

    layers = [("px", ["x"]), ("py", ["y"]), ("mix", ["px", "py"]), ("head", ["mix"])]
    stage_of = {"px": 0, "py": 1, "mix": 1, "head": 2}
    sg = derive_partition(build_layer_graph(["x", "y"], layers), stage_of, num_stages=3).stage_graph
    assert sg.preds(1) == [0] and sg.loading == {0, 1, 2}
    assert StageGraph.from_json(sg.to_json()) == sg
    db = synthetic_db(layers, inputs=("x", "y"))
    for name, spec in ((n, x) for n, x in SCHEDULES.items() if x.folded is None):   # priced per stage
        plan = Plan(model="m", method="manual", source="test", micro_batch=1, mini_batch=4, schedule=name,
                    stages=tuple(PlanStage(layers=tuple(n for n, _ in layers if stage_of[n] == s)) for s in range(3)))
        # what the engine runs once the pipeline is full (an asynchronous schedule's steady batch)
        program = ProgramFactory(sg, schedule=name).program(4).actions
        if spec.asynchronous:
            assert program == AsyncProgram(sg, 4, schedule=name, layouts=True).batch(steady_batch_idx(sg, 4)).actions
        else:
            assert program == build_program(sg, 4, schedule=name).actions
        for s in range(3):
            loads = [a.mb_idx for a in program[s] if a.kind is K.LOAD]
            assert loads == [a.mb_idx for a in program[s] if a.kind is K.FORWARD], (name, s)
        assert simulate_plan(plan, db).schedule == program, name


def test_every_action_kind_declares_what_it_uses_and_releases_free_what_the_kinds_write():
    from gpp_deepspeed.schedule import KINDS, RELEASES, Buffer
    assert set(KINDS) == set(ActionKind)
    written = {b for spec in KINDS.values() for b in spec.writes}
    freed = {b for k in RELEASES for b in KINDS[k].frees}
    assert written == freed == set(Buffer), "every buffer a kind writes has a release that frees it"
    assert [k for k in RELEASES] == [K.RELEASE_OUT, K.RELEASE_IN, K.RELEASE_W]


def test_add_release_frees_a_split_backwards_outputs_after_i_and_its_weight_work_after_w():
    before = {1: lists("1RECV_F0@0 1F0 1SEND_F0@2 1RECV_B0@2 1I0 1SEND_B0@0 1W0")}
    after = {1: lists("1RECV_F0@0 1F0 1SEND_F0@2 1RECV_B0@2 1I0 1RELEASE_OUT0 1SEND_B0@0 1RELEASE_IN0 1W0 "
                      "1RELEASE_W0")}
    assert add_release(before) == after


@pytest.mark.parametrize("name", ["1f1b", "zb1"])
@pytest.mark.parametrize("kind", [K.RELEASE_OUT, K.RELEASE_IN, K.RELEASE_W])
def test_validate_program_refuses_a_program_with_a_release_missing(name, kind):
    sg = dag(3, [(0, 2), (1, 2)])
    program = build_program(sg, 3, schedule=name)
    validate_program(program, sg)
    stage = 2   # the output stage: it sends gradients back, so it keeps a split backward
    dropped = next((a for a in program.actions[stage] if a.kind is kind and a.mb_idx == 1), None)
    if dropped is None:
        assert kind is K.RELEASE_W and name == "1f1b"   # a fused backward leaves nothing for W
        return
    actions = {**program.actions, stage: [a for a in program.actions[stage] if a != dropped]}
    with pytest.raises(ScheduleError, match=rf"stage 2 never frees micro-batch 1's .*no 2{kind.value}1 after"):
        validate_program(dataclasses.replace(program, actions=actions), sg)


def test_validate_schedule_rejects_a_weight_pass_after_its_work_was_released():
    good = {0: "0LOAD0 0F0 0I0 0RELEASE_OUT0 0RELEASE_IN0 0W0 0RELEASE_W0 0WAIT_SENDS"}
    validate_schedule(parse_schedule(good), StageGraph.chain(1), 1, train=True)
    broken = {0: "0LOAD0 0F0 0I0 0RELEASE_OUT0 0RELEASE_IN0 0RELEASE_W0 0W0 0WAIT_SENDS"}
    with pytest.raises(ScheduleError, match="0W0 uses what 0RELEASE_W0 freed"):
        validate_schedule(parse_schedule(broken), StageGraph.chain(1), 1, train=True)
    early = {0: "0LOAD0 0F0 0RELEASE_OUT0 0I0 0RELEASE_IN0 0W0 0RELEASE_W0 0WAIT_SENDS"}
    with pytest.raises(ScheduleError, match="0I0 uses what 0RELEASE_OUT0 freed"):
        validate_schedule(parse_schedule(early), StageGraph.chain(1), 1, train=True)


def test_program_prints_every_stages_actions_and_buffer_slots():
    from gpp_deepspeed.schedule import build_program
    program = build_program(StageGraph.chain(2), 2, schedule="gpipe")
    lines = str(program).splitlines()
    assert lines[0] == 'program "gpipe": 2 stages, 2 micro-batches, training'
    assert lines[1] == "stage 0: " + " ".join(map(str, program.actions[0]))
    assert lines[2] == "  slots: 0:0 1:1"   # GPipe holds both micro-batches at once
    assert program.num_buffers(0) == 2


# ---------------------------------------------------------------------------------------------
# Layouts (dynamic shapes): one group per action on the wire, stream order, whole-group completion

# Stage 0 fans out to 1, 2 and 3, which also reads 1 and 2 (an inception block); a U-Net with two
# skips; a chain.
INCEPTION = dag(4, [(0, 1), (0, 2), (0, 3), (1, 3), (2, 3)])
UNET = dag(5, [(0, 1), (1, 2), (2, 3), (3, 4), (0, 4), (1, 3)])


def posted_as_the_old_transport_did(schedule):
    """Each transfer action as the transport before layout actions posted it under
    ``dynamic_shape``: one batch with every send (each activation's layout in front of it) and the
    gradient receives, then, one by one after the batch, each activation receive's layout and the
    activations. Under stream order each of those starts only once the batch has completed."""
    out = {}
    for s, actions in schedule.items():
        out[s] = []
        for a in actions:
            if not a.kind.is_transfer:
                out[s].append(a)
                continue
            batch = [x for op in a.transfers if op.kind is not K.RECV_F
                     for x in ([Action(s, K.SEND_L, op.mb_idx, op.peer)] if op.kind is K.SEND_F else []) + [op]]
            if batch:
                out[s].append(batch[0] if len(batch) == 1 else Action.group(batch))
            out[s] += [x for op in a.transfers if op.kind is K.RECV_F
                       for x in (Action(s, K.RECV_L, op.mb_idx, op.peer), op)]
    return out


@pytest.mark.parametrize("sg,name", [(INCEPTION, "1f1b"), (INCEPTION, "zb2"), (UNET, "1f1b"), (UNET, "zb2"),
                                     (StageGraph.chain(4), "zb2")])
def test_validator_rejects_late_layout_receives_after_a_batch_the_deadlock_of_issue_18(sg, name):
    program = build_program(sg, 4, schedule=name, early=False)   # the old transport knew no waits
    with pytest.raises(ScheduleError, match="deadlocks under rendezvous"):
        simulate(posted_as_the_old_transport_did(program.actions), mode="rendezvous")
    # The same batch with its layouts as actions of their own, grouped apart from the activations.
    validate_program(build_program(sg, 4, schedule=name, layouts=True), sg)


def test_the_issue_18_example_stage_3_batches_gradients_before_late_receives_that_stage_0_waits_for():
    stuck = posted_as_the_old_transport_did(build_program(INCEPTION, 4, schedule="1f1b", early=False).actions)
    with pytest.raises(ScheduleError) as err:
        simulate(stuck, mode="rendezvous")
    text = str(err.value)
    assert "stage 0 at (0SEND_L1@1;0SEND_F1@1;0SEND_L1@2;0SEND_F1@2;0SEND_L1@3;0SEND_F1@3)P2P" in text
    assert "0SEND_F1@3 waits for stage 3 to post its receive" in text


@pytest.mark.parametrize("sg", [INCEPTION, UNET, StageGraph.chain(3), dag(4, [(0, 1), (0, 2), (1, 3), (2, 3)])])
def test_layout_programs_of_every_schedule_pass_the_validator_and_send_each_layout_before_its_activations(sg):
    for name, spec in SCHEDULES.items():
        if spec.asynchronous:
            validate_async(sg, sg.num_stages, schedule=name, layouts=True)
            continue
        if spec.folded is not None and spec.folded.fold == "v" and sg.num_stages % 2:
            continue   # a V pairs stages up
        for train in (True, False):
            program = build_program(sg, 4, schedule=name, train=train, layouts=True)
            validate_program(program, sg)
            for s, actions in program.actions.items():
                ops = [op for a in actions for op in a.transfers]
                for i, op in enumerate(ops):
                    if op.kind in (K.SEND_F, K.RECV_F):
                        layout = K.SEND_L if op.kind is K.SEND_F else K.RECV_L
                        assert ops[i - 1] == Action(op.stage_idx, layout, op.mb_idx, op.peer), (name, s, op)


def test_validator_rejects_an_activation_receive_grouped_with_its_own_layout():
    sg = StageGraph.chain(2)
    sched = parse_schedule({0: "0F0 0SEND_L0@1 0SEND_F0@1 0WAIT_SENDS",
                            1: "1RECV_L0@0 1RECV_F0@0 1F0 1WAIT_SENDS"})
    validate_schedule(sched, sg, 1, train=False, layouts=True, releases=False)
    sched[1] = [Action.group(sched[1][:2]), *sched[1][2:]]
    with pytest.raises(ScheduleError, match="needs 1RECV_L0@0 in an earlier action, not in the same one"):
        validate_schedule(sched, sg, 1, train=False, layouts=True, releases=False)
    with pytest.raises(ScheduleError, match="in a program without layouts"):
        validate_schedule(parse_schedule({0: "0F0 0SEND_L0@1 0SEND_F0@1", 1: "1RECV_L0@0 1RECV_F0@0 1F0"}),
                          sg, 1, train=False, releases=False)


def test_validator_rejects_a_layout_received_where_activations_were_sent():
    sched = parse_schedule({0: "0F0 0SEND_F0@1 0F1 0SEND_L1@1 0SEND_F1@1",
                            1: "1RECV_L0@0 1RECV_F0@0 1F0 1RECV_L1@0 1RECV_F1@0 1F1"})
    with pytest.raises(ScheduleError, match="message 0 on channel 0->1 .F. is activations of micro-batch 0 but "
                                            "its receive expects a layout"):
        simulate(sched, mode="rendezvous")
