"""A message's cost as the engine incurs it: busy time at both ends, and a latency in flight that
overlaps other work and that a grouped transfer pays once (pure, no torch).

The references are iterations written out by hand, action by action, from the link model
(:class:`~gpp_deepspeed.planner.costs.CommFit`: each end busy ``overhead_s`` per message, a
message in flight ``alpha_s - 2 * overhead_s`` once both ends have posted it, ``late_receive_s``
more when its receive was posted last), and the paper's stage time for a link without an
overhead (the whole ``alpha_s`` busy at both ends).
"""

from __future__ import annotations

import pytest

from costdbs import branches, chain, hardware
from gpp_deepspeed.errors import GPPConfigError
from gpp_deepspeed.graph.stages import StageGraph
from gpp_deepspeed.planner import CommFit, StageCostModel
from gpp_deepspeed.planner.plan import Plan, PlanStage
from gpp_deepspeed.planner.search import graphpipe_search
from gpp_deepspeed.planner.simulate import simulate_plan
from gpp_deepspeed.schedule import build_program, simulate
from gpp_deepspeed.schedule.ir import ActionKind as K

OVERHEAD, LATENCY = 0.1, 0.3
SPLIT = CommFit(alpha_s=2 * OVERHEAD + LATENCY, beta_s_per_byte=0.0, overhead_s=OVERHEAD)
BLOCKING = CommFit(alpha_s=2 * OVERHEAD + LATENCY, beta_s_per_byte=0.0)


def fan_in(k: int, link: CommFit):
    """``k`` one-layer branches (forward 1 s, backward 2 s, one single-rank stage each) into a merge
    layer of the same times on a stage of its own; one micro-batch of one sample."""
    db = branches(k, 1, out_bytes={f"b{i}_0": 4 for i in range(k)}, hw=hardware(link=link))
    plan = Plan(model="fan_in", method="manual", source="test", micro_batch=1, mini_batch=1,
                stages=(*(PlanStage(layers=(f"b{i}_0",)) for i in range(k)), PlanStage(layers=("cat",))))
    return db, plan


def test_a_link_splits_an_isolated_message_into_busy_ends_and_a_latency_in_flight():
    assert (SPLIT.busy(4.0), SPLIT.latency_s, SPLIT.time(4.0)) == pytest.approx((0.1, 0.3, 0.5))
    # the paper's stage time: the whole fixed cost busy at both ends, nothing in flight
    assert (BLOCKING.busy(4.0), BLOCKING.latency_s) == pytest.approx((0.5, 0.0))
    assert SPLIT.busy(0.0) == 0.0


def test_a_link_whose_overhead_exceeds_half_its_end_to_end_time_is_refused_naming_both():
    with pytest.raises(GPPConfigError, match=r"overhead_s = 0.3 s .* alpha_s = 0.5 s"):
        CommFit(alpha_s=0.5, beta_s_per_byte=0.0, overhead_s=0.3)


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_a_merge_receiving_k_messages_in_one_group_is_busy_k_times_and_waits_the_latency_once(k):
    db, plan = fan_in(k, SPLIT)
    # Every branch: F (1 + o), its send in flight L, the merge's grouped receive done; the merge:
    # F (1 + k o), B (2 + k o), its k gradients in flight L (sent as one group); every branch:
    # B (2 + o). The branches run side by side, so the iteration is one branch and the merge.
    expected = (1 + OVERHEAD) + LATENCY + (1 + k * OVERHEAD) + (2 + k * OVERHEAD) + LATENCY + (2 + OVERHEAD)
    assert simulate_plan(plan, db).prediction.iteration_time_s == pytest.approx(expected)
    if k == 4:
        assert expected == pytest.approx(7.6)


@pytest.mark.parametrize("k", [1, 4])
def test_a_link_without_an_overhead_keeps_both_ends_busy_for_every_message(k):
    db, plan = fan_in(k, BLOCKING)
    alpha = BLOCKING.alpha_s
    expected = (1 + alpha) + (1 + k * alpha) + (2 + k * alpha) + (2 + alpha)
    assert simulate_plan(plan, db).prediction.iteration_time_s == pytest.approx(expected)


def test_a_two_stage_chain_waits_the_latency_after_a_receive_posted_behind_its_send():
    # 1F1B, two micro-batches; forward 1 s and backward 2 s per stage, each stage busy o per
    # message. Stage 1 posts its receive of micro-batch 1 only after B0 (at 4 + 3o + L), long
    # after stage 0 sent it (2 + 2o): the message moves once both ends are posted, L later.
    db = chain(2, out_bytes={"l0": 4}, hw=hardware(link=SPLIT))
    plan = Plan(model="chain", method="manual", source="test", micro_batch=1, mini_batch=2,
                stages=(PlanStage(layers=("l0",)), PlanStage(layers=("l1",))))
    o, lat = OVERHEAD, LATENCY
    f0_on_1 = (1 + o) + lat                      # stage 0's F0, then in flight
    b0_on_1_done = f0_on_1 + (1 + o) + (2 + o)   # stage 1's F0 and B0
    f1_arrives = b0_on_1_done + lat              # posted behind its send: the latency from then
    b1_on_1_done = f1_arrives + (1 + o) + (2 + o)
    b0_on_0_done = b0_on_1_done + lat + (2 + o)  # stage 0 waits for B0's gradient since 2 + 2o
    b1_on_0_done = max(b0_on_0_done, b1_on_1_done + lat) + (2 + o)
    assert b1_on_0_done == pytest.approx(9 + 6 * o + 3 * lat)
    assert simulate_plan(plan, db, early=False).prediction.iteration_time_s == pytest.approx(b1_on_0_done)
    # Posted early (the default: before F0, as stage 0 sends F1 while stage 1 runs it), F1 is there
    # when B0 ends: one latency less on the way to the end.
    b1_on_1_early = b0_on_1_done + (1 + o) + (2 + o)
    assert simulate_plan(plan, db).prediction.iteration_time_s == pytest.approx(
        max(b0_on_0_done, b1_on_1_early + lat) + (2 + o)) == pytest.approx(9 + 6 * o + 2 * lat)


def test_a_receive_posted_behind_its_send_waits_the_late_receive_time_on_top_and_only_it():
    # The same chain on a link where a message whose receive comes last waits 0.2 s more (gloo's
    # receive-ready notice): only F1's receive on stage 1 is posted behind its send; every other
    # receive is posted first and waits for its send.
    late = 0.2
    link = CommFit(alpha_s=SPLIT.alpha_s, beta_s_per_byte=0.0, overhead_s=OVERHEAD, late_receive_s=late)
    db = chain(2, out_bytes={"l0": 4}, hw=hardware(link=link))
    plan = Plan(model="chain", method="manual", source="test", micro_batch=1, mini_batch=2,
                stages=(PlanStage(layers=("l0",)), PlanStage(layers=("l1",))))
    o, lat = OVERHEAD, LATENCY
    b0_on_1_done = (1 + o) + lat + (1 + o) + (2 + o)
    b1_on_1_done = b0_on_1_done + lat + late + (1 + o) + (2 + o)
    b0_on_0_done = b0_on_1_done + lat + (2 + o)
    assert simulate_plan(plan, db, early=False).prediction.iteration_time_s == pytest.approx(
        max(b0_on_0_done, b1_on_1_done + lat) + (2 + o))
    # Posted early, no receive comes behind its send: neither the latency nor the late-receive time
    # is on F1's way.
    b1_on_1_early = b0_on_1_done + (1 + o) + (2 + o)
    assert simulate_plan(plan, db).prediction.iteration_time_s == pytest.approx(
        max(b0_on_0_done, b1_on_1_early + lat) + (2 + o))


def test_a_negative_late_receive_time_is_refused():
    with pytest.raises(GPPConfigError, match="late_receive_s = -0.1 s"):
        CommFit(alpha_s=0.5, beta_s_per_byte=0.0, overhead_s=0.1, late_receive_s=-0.1)


def test_the_schedule_simulator_starts_a_message_when_the_later_of_its_two_ends_is_posted():
    # Forward only, two micro-batches: stage 0 sends F0 at 1 and F1 at 2; stage 1 (5 s a forward)
    # posts its receive of F1 at 6 + L, so F1 arrives at 6 + 2L, not at 2 + L.
    sched = build_program(StageGraph.chain(2), 2, schedule="1f1b", train=False, early=False).actions
    lat = 0.5

    def duration(a):
        return {0: 1.0, 1: 5.0}[a.stage_idx] if a.kind is K.FORWARD else 0.0

    assert simulate(sched, duration=duration, latency=lat).makespan == pytest.approx(1 + lat + 5 + lat + 5)
    # the receive of F1 came last: with a late-receive time it waits that much more
    assert simulate(sched, duration=duration, latency=lat, late_receive=0.25).makespan == \
        pytest.approx(1 + lat + 5 + lat + 0.25 + 5)
    # posted early (with F0's), F1 moves as it is sent, at 2, and is there long before F0 ends
    early = build_program(StageGraph.chain(2), 2, schedule="1f1b", train=False).actions
    assert simulate(early, duration=duration, latency=lat, late_receive=0.25).makespan == pytest.approx(1 + lat + 5 + 5)


def test_the_search_prices_a_stages_messages_as_the_simulator_does():
    # The merge stage of a fan-in of 4: the search's time per sample is the simulated stage's
    # forward and backward, each busy 4 o for its messages (no latency: it overlaps).
    db, plan = fan_in(4, SPLIT)
    model = StageCostModel(db, 1)
    merge = model.mask_of(["cat"])
    sim = simulate_plan(plan, db)
    assert model.time_per_sample(merge, 1, 1) == pytest.approx((1 + 4 * OVERHEAD) + (2 + 4 * OVERHEAD))
    assert model.time_per_sample(merge, 1, 1) == pytest.approx(sim.stage_costs[-1].fwd_s + sim.stage_costs[-1].bwd_s)


@pytest.mark.parametrize("link, merge_tps", [(SPLIT, 3 + 8 * OVERHEAD), (BLOCKING, 3 + 8 * BLOCKING.alpha_s)])
def test_the_searchs_bottleneck_is_a_merges_compute_and_the_busy_part_of_its_messages(link, merge_tps):
    # A fan-in of 4 on 5 devices: every layer a stage; the merge is the bottleneck with 4
    # messages each way (a latency in flight is not part of a stage's time per sample).
    db, _ = fan_in(4, link)
    plan = graphpipe_search(db, num_devices=5, mini_batch=1).plan
    assert plan.num_stages == 5
    assert plan.notes["bottleneck_tps_s"] == pytest.approx(merge_tps, rel=2e-3)
