"""Zero-bubble schedules (split backward): IR strings, the paper's closed form, memory bounds, and
the validator on random stage DAGs. Pure, CPU-only.

The closed forms are those of Qi et al., "Zero Bubble Pipeline Parallelism" (arXiv 2401.10241),
Sec. 3: on a chain of ``p`` stages, 1F1B's bubble is ``(p - 1)(T_F + T_B)`` with
``T_B = T_I + T_W``, and ZB-H1's is ``(p - 1)(T_F + T_I - T_W)``.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpp_deepspeed.errors import ScheduleError
from gpp_deepspeed.graph import StageGraph
from gpp_deepspeed.schedule import (Action, ActionKind, assign_buffers, build_schedule, num_slots, one_f_one_b,
                                    peak_in_flight, simulate, validate_schedule, zb1, zb2)
from gpp_deepspeed.schedule.lowering import (add_epilogue, add_load, add_release, add_send_recv, group_for_rendezvous,
                                            lower)

from liveness import check_slots
from test_schedule import dag, modulo_slots, parse_schedule, stage_dags

K = ActionKind


def durations(tf, ti, tw):
    return lambda a: {K.FORWARD: tf, K.BACKWARD_INPUT: ti, K.BACKWARD_WEIGHT: tw, K.BACKWARD: ti + tw}.get(a.kind, 0.0)


def bubble(schedule, num_mb, tf, ti, tw):
    """Makespan minus one stage's compute: the idle time of the (equally loaded) stages."""
    return simulate(schedule, duration=durations(tf, ti, tw)).makespan - num_mb * (tf + ti + tw)


def test_split_backward_actions_have_torch_string_forms_that_round_trip():
    assert str(Action(2, K.BACKWARD_INPUT, 0)) == "2I0"
    assert str(Action(2, K.BACKWARD_WEIGHT, 0)) == "2W0"
    for text in ("2I0", "2W0", "13W7", "0I12"):
        assert str(Action.parse(text)) == text
    assert Action.parse("0W3").kind is K.BACKWARD_WEIGHT  # not read as WAIT_SENDS
    assert Action.parse("0WAIT_SENDS").kind is K.WAIT_SENDS


@pytest.mark.parametrize("num_stages", [2, 3, 4, 6, 8])
@pytest.mark.parametrize("rounds", [1, 2, 3])
def test_zb1_bubble_on_a_chain_with_equal_times_is_the_papers_closed_form(num_stages, rounds):
    p, m = num_stages, rounds * num_stages
    tf = ti = tw = 1.0
    zb_h1 = (p - 1) * (tf + ti - tw)              # ZB-H1, arXiv 2401.10241 Sec. 3.1
    one_f_one_b_bubble = (p - 1) * (tf + ti + tw)  # 1F1B with T_B = T_I + T_W
    sg = StageGraph.chain(p)
    assert bubble(build_schedule(sg, m, name="zb1"), m, tf, ti, tw) == zb_h1
    assert bubble(build_schedule(sg, m, name="1f1b"), m, tf, ti, tw) == one_f_one_b_bubble
    assert zb_h1 * 3 == one_f_one_b_bubble


@pytest.mark.parametrize("times", [(1.0, 1.0, 0.5), (1.0, 2.0, 1.0), (2.0, 1.0, 1.0)])
def test_zb1_bubble_on_a_chain_follows_the_closed_form_for_unequal_times(times):
    tf, ti, tw = times
    p, m = 4, 8
    assert bubble(build_schedule(StageGraph.chain(p), m, name="zb1"), m, *times) == (p - 1) * (tf + ti - tw)


@pytest.mark.parametrize("times", [(1.0, 1.0, 1.0), (1.0, 1.0, 0.5), (1.0, 2.0, 1.0), (2.0, 1.0, 1.0)])
def test_zb2_on_a_chain_reaches_the_floor_of_the_output_stage_starting_late(times):
    # The output stage cannot start before the first micro-batch crossed p - 1 stages: (p - 1) T_F
    # is a floor for any schedule that finishes a batch before the next begins.
    tf, ti, tw = times
    p, m = 4, 8
    sg = StageGraph.chain(p)
    # the same compute times order the transfers, which zb2's greedy order needs under NCCL
    sched = lower(zb2(sg, m, duration=lambda a: durations(*times)(a)), sg, train=True, duration=durations(*times))
    assert bubble(sched, m, *times) >= (p - 1) * tf
    if ti <= tf:
        assert bubble(sched, m, *times) == (p - 1) * tf
    # With T_I > T_F the greedy order runs stage 0's I(j + 1) before its W(j); stage 0 has no input
    # gradient to send, so its backward runs whole at W(j)'s place (merge_backward), after the
    # receive of j + 1's gradient: the first stage pays for it, as the engine always did (below).


@pytest.mark.parametrize("times", [(1.0, 1.0, 1.0), (1.0, 2.0, 1.0), (2.0, 1.0, 0.5)])
@pytest.mark.parametrize("name", ["zb1", "zb2"])
def test_merging_the_backward_of_a_stage_with_nothing_to_send_times_what_its_split_backward_ran(times, name):
    # Before merge_backward, a source stage ran nothing at I and its whole backward at W: the split
    # program priced that way (I free, W = I + W on stage 0) times exactly as the merged program.
    tf, ti, tw = times
    sg = dag(4, [(0, 1), (1, 3), (2, 3)])
    generator = zb1 if name == "zb1" else (lambda g, m: zb2(g, m, duration=durations(*times)))
    compute = generator(sg, 6)
    merged = lower(compute, sg, train=True, duration=durations(*times), early=False)   # as the split one
    assert {s for s in merged for a in merged[s] if a.kind is K.BACKWARD} == {0, 2}

    split = add_epilogue(add_release(group_for_rendezvous(add_send_recv(add_load(compute, sg), sg),
                                                          duration=durations(*times))), train=True)
    fused = {K.BACKWARD_INPUT: 0.0, K.BACKWARD_WEIGHT: ti + tw}

    def as_run(a):
        return fused.get(a.kind, durations(*times)(a)) if a.stage_idx in (0, 2) else durations(*times)(a)
    assert simulate(merged, duration=durations(*times)).makespan == simulate(split, duration=as_run).makespan


def test_zb1_holds_no_more_micro_batches_than_the_busiest_stage_of_1f1b():
    sg = dag(6, [(0, 1), (1, 2), (2, 5), (3, 5), (4, 5)])
    for m in (2, 5, 12):
        ours, base = zb1(sg, m), one_f_one_b(sg, m)
        busiest = max(peak_in_flight(base[s]) for s in base)
        assert max(peak_in_flight(ours[s]) for s in ours) == busiest
        assert all(peak_in_flight(ours[s]) <= busiest for s in ours)


def test_validator_rejects_a_weight_gradient_before_its_input_gradient():
    good = {
        0: "0LOAD0 0F0 0SEND_F0@1 0RECV_B0@1 0I0 0W0 0WAIT_SENDS",
        1: "1LOAD0 1RECV_F0@0 1F0 1I0 1SEND_B0@0 1W0 1WAIT_SENDS",
    }
    validate_schedule(parse_schedule(good), StageGraph.chain(2), 1, train=True, releases=False)
    broken = {**good, 1: "1LOAD0 1RECV_F0@0 1F0 1W0 1I0 1SEND_B0@0 1WAIT_SENDS"}
    with pytest.raises(ScheduleError, match="1W0 before 1I0"):
        validate_schedule(parse_schedule(broken), StageGraph.chain(2), 1, train=True, releases=False)
    with pytest.raises(ScheduleError, match="never runs 1W0"):
        validate_schedule(parse_schedule({**good, 1: "1LOAD0 1RECV_F0@0 1F0 1I0 1SEND_B0@0 1WAIT_SENDS"}),
                          StageGraph.chain(2), 1, train=True, releases=False)
    with pytest.raises(ScheduleError, match="split backward of the same micro-batch"):
        validate_schedule(parse_schedule({**good, 1: "1LOAD0 1RECV_F0@0 1F0 1I0 1SEND_B0@0 1W0 1B0 1WAIT_SENDS"}),
                          StageGraph.chain(2), 1, train=True, releases=False)


def test_validator_rejects_a_buffer_reused_while_a_weight_gradient_is_pending():
    sg = StageGraph.chain(3)
    sched = build_schedule(sg, 6, name="zb1")
    slots = assign_buffers(sched)  # a micro-batch keeps its buffer until its W
    validate_schedule(sched, sg, 6, train=True, slots=slots)
    need = {s: num_slots(slots[s]) for s in sched}
    tight = {**need, 2: need[2] - 1}
    with pytest.raises(ScheduleError, match="share buffer"):
        validate_schedule(sched, sg, 6, train=True, slots=modulo_slots(tight))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sg=stage_dags(), num_mb=st.integers(1, 7))
def test_zero_bubble_schedules_on_random_stage_dags_pass_the_validator_and_compute_what_1f1b_computes(sg, num_mb):
    n = sg.num_stages
    top = max(sg.depth(s) for s in range(n))
    base = build_schedule(sg, num_mb, name="1f1b")
    base_span = simulate(base).makespan
    for name, cap in (("zb1", top), ("zb2", 2 * top - 1)):
        sched = build_schedule(sg, num_mb, name=name)
        check_slots(sched, assign_buffers(sched))   # a micro-batch keeps its slot until its W (or B)
        validate_schedule(sched, sg, num_mb, train=True)  # rendezvous-safe
        assert simulate(sched).makespan <= base_span  # never slower than 1F1B with B = I + W
        for s in range(n):
            kinds = [(a.kind, a.mb_idx) for a in sched[s]]
            # every micro-batch: one F and one I and one W, or one fused B where there is no input
            # gradient to send (merge_backward)
            split = [1, 1, 1, 0] if sg.grad_preds(s) else [1, 0, 0, 1]
            for j in range(num_mb):
                assert [kinds.count((k, j)) for k in (K.FORWARD, K.BACKWARD_INPUT, K.BACKWARD_WEIGHT, K.BACKWARD)] \
                    == split
            assert peak_in_flight(sched[s]) <= min(cap, num_mb)
