"""The planner's memory and collectives under ZeRO stages 0-3, against hand-computed numbers.

The per-rank weight state is the ZeRO paper's (Rajbhandari et al., SC 2020, Sec. 5, Fig. 1); its
collectives are Sec. 7.2's volumes, priced with the ring of ``allreduce_time``. Each search case
is built so that the feasible plans can be listed by hand (the numbers are in the comments).
"""

from __future__ import annotations

import json

import pytest

from costdbs import chain, hardware
from gpp_deepspeed.errors import GPPConfigError
from gpp_deepspeed.planner import ZERO_STAGES, CommFit, Plan, PlanStage, weight_state_bytes
from gpp_deepspeed.planner.search import graphpipe_search
from gpp_deepspeed.planner.simulate import choose_zero_stage, simulate_plan

LINK = CommFit(alpha_s=0.0, beta_s_per_byte=1e-9)
MB = 1e6


def test_weight_state_bytes_gives_the_zero_papers_120_31_4_16_6_1_9_gb_for_7_5b_parameters_on_64_ranks():
    # ZeRO Fig. 1: Psi = 7.5B, K = 12, N_d = 64, fp16 parameters and gradients (2 bytes each):
    #   baseline (2 + 2 + 12) * 7.5e9          = 120 GB
    #   P_os     4 * 7.5e9 + 12 * 7.5e9 / 64   = 30 + 1.40625   = 31.40625 GB
    #   P_os+g   2 * 7.5e9 + 14 * 7.5e9 / 64   = 15 + 1.640625  = 16.640625 GB
    #   P_os+g+p 16 * 7.5e9 / 64                                 = 1.875 GB
    # In the cost model's terms: param_bytes = 2 Psi, optimizer_factor = (2 + 12) / 2 = 7.
    psi = 7.5e9
    got = [weight_state_bytes(2 * psi, optimizer_factor=7.0, num_devices=64, zero_stage=z) for z in ZERO_STAGES]
    assert got == pytest.approx([120e9, 31.40625e9, 16.640625e9, 1.875e9], rel=1e-12)
    assert [round(x / 1e9, 1) for x in got] == [120.0, 31.4, 16.6, 1.9]   # as printed in the paper


def test_weight_state_bytes_in_fp32_adam_counts_4_4_and_8_bytes_per_parameter():
    # 1M fp32 parameters with Adam's two fp32 moments (optimizer_factor 3) on 4 ranks:
    # 4 + 4 + 8 = 16 MB; 4 + 4 + 8/4 = 10 MB; 4 + 12/4 = 7 MB; 16/4 = 4 MB.
    got = [weight_state_bytes(4 * MB, optimizer_factor=3.0, num_devices=4, zero_stage=z) for z in ZERO_STAGES]
    assert got == pytest.approx([16 * MB, 10 * MB, 7 * MB, 4 * MB])
    # One rank partitions nothing.
    assert {weight_state_bytes(4 * MB, optimizer_factor=3.0, num_devices=1, zero_stage=z) for z in ZERO_STAGES} \
        == {16 * MB}


def test_weight_state_bytes_refuses_a_zero_stage_deepspeed_does_not_have():
    with pytest.raises(GPPConfigError, match=r"one of \[0, 1, 2, 3\].*got 4"):
        weight_state_bytes(1.0, optimizer_factor=3.0, num_devices=2, zero_stage=4)


def _one_stage(zero_stage: int, num_microbatches: int) -> tuple[Plan, object]:
    """One layer of 1 MB parameters on one stage of 4 ranks; compute takes no time, so an
    iteration is its collectives alone."""
    db = chain(1, fwd={"l0": 0.0}, bwd={"l0": 0.0}, param_bytes={"l0": MB},
               hw=hardware(optimizer_factor=3.0, link=LINK))
    plan = Plan(model="m", method="manual", source="hand", micro_batch=4, mini_batch=4 * num_microbatches,
                stages=(PlanStage(layers=("l0",), devices=4),), zero_stage=zero_stage)
    return plan, db


@pytest.mark.parametrize("num_microbatches, expected_ms", [
    # A ring all-gather or reduce-scatter of 1 MB on 4 ranks: 3 steps of 0.25 MB at 1 ns/byte = 0.75 ms;
    # an all-reduce is both, 1.5 ms.
    # One micro-batch (ZeRO Sec. 7.2): ZeRO-1 and -2 move what the all-reduce moves; ZeRO-3 adds an
    # all-gather for the backward: 3 x 0.75 = 2.25 ms, 1.5 times as much.
    (1, {0: 1.5, 1: 1.5, 2: 1.5, 3: 2.25}),
    # Four micro-batches: ZeRO-2 reduce-scatters each one's gradients (4 x 0.75) and all-gathers the
    # updated parameters once (0.75); ZeRO-3 gathers twice and scatters once per micro-batch (12 x 0.75).
    (4, {0: 1.5, 1: 1.5, 2: 3.75, 3: 9.0}),
])
def test_zero_2_and_3_collectives_per_micro_batch_cost_what_the_zero_paper_counts(num_microbatches, expected_ms):
    for z, ms in expected_ms.items():
        plan, db = _one_stage(z, num_microbatches)
        assert simulate_plan(plan, db).prediction.iteration_time_s == pytest.approx(ms * 1e-3, rel=1e-9), z


def test_zero_3_holds_one_gathered_layer_besides_its_partitions():
    # Two layers of 1 MB and 3 MB on 4 ranks, fp32 Adam: 16 MB of state / 4 = 4 MB, plus the
    # 3 MB layer gathered whole while it computes.
    db = chain(2, param_bytes={"l0": MB, "l1": 3 * MB}, hw=hardware(optimizer_factor=3.0, link=LINK))
    plan = Plan(model="m", method="manual", source="hand", micro_batch=4, mini_batch=4,
                stages=(PlanStage(layers=("l0", "l1"), devices=4),), zero_stage=3)
    assert simulate_plan(plan, db).prediction.peak_mem_bytes == pytest.approx(7 * MB)


def _eight_layers(memory_bytes: float):
    """Eight layers of 1 MB parameters (fp32 Adam: 4 MB of state each) that stash 0.1 MB per
    sample, measured at micro-batch 4 only, with 16 samples per iteration on 4 devices."""
    names = [f"l{i}" for i in range(8)]
    return chain(8, param_bytes=dict.fromkeys(names, MB), stash_bytes=dict.fromkeys(names, 0.1 * MB),
                 micro_batches=(4,), hw=hardware(memory_bytes=memory_bytes, optimizer_factor=3.0, link=LINK))


def _search(db, zero_stages, *, mini_batch=16):
    return graphpipe_search(db, num_devices=4, mini_batch=mini_batch, micro_batches=(4,), zero_stages=zero_stages)


def test_eight_layers_that_fit_only_under_zero_3_get_one_stage_of_four_ranks_from_auto():
    # Under 10 MB: four stages of two layers hold 8 MB of state and, on the first, 4 micro-batches
    # x 2 layers x 0.1 MB x 4 samples = 3.2 MB (11.2 MB); two stages of two ranks hold at least
    # ZeRO-2's 4 + 12/2 = 10 MB plus 1.6 MB; ZeRO-3 on one stage of four ranks holds 32/4 = 8 MB,
    # one gathered layer (1 MB) and 8 layers x 0.1 MB x 1 sample (0.8 MB): 9.8 MB.
    db = _eight_layers(10 * MB)
    for z in (0, 1, 2):
        result = _search(db, (z,))
        assert result.plan is None and (z == 0 or f"under ZeRO stage {z}" in result.status)
    plan = _search(db, ZERO_STAGES).plan
    assert plan.zero_stage == 3
    assert [(len(s.layers), s.devices) for s in plan.stages] == [(8, 4)]
    assert plan.predicted.peak_mem_bytes == pytest.approx(9.8 * MB)


def test_a_layer_that_fits_only_under_zero_2_gets_it_from_auto():
    # One 1 MB layer (fp32 Adam) and a parameter-free head under 1.9 MB per device, 4 devices:
    # ZeRO-0 holds 4 MB; ZeRO-1 at least 1 + 1 + 2/4 = 2.5 MB; ZeRO-3 4/4 + the gathered layer =
    # 2 MB; ZeRO-2 on four ranks 1 + 3/4 = 1.75 MB, the only one that fits.
    db = chain(2, param_bytes={"l0": MB}, hw=hardware(memory_bytes=1.9 * MB, optimizer_factor=3.0, link=LINK))
    for z in (0, 1, 3):
        assert graphpipe_search(db, num_devices=4, mini_batch=8, zero_stages=(z,)).plan is None
    plan = graphpipe_search(db, num_devices=4, mini_batch=8, zero_stages=ZERO_STAGES).plan
    assert plan.zero_stage == 2 and plan.predicted.peak_mem_bytes == pytest.approx(1.75 * MB)


def test_auto_takes_zero_1_when_it_lets_the_whole_model_run_data_parallel_within_the_memory():
    # No stash, 20 MB per device, 8 samples: ZeRO-0 must pipeline (one stage of four ranks holds
    # 32 MB); ZeRO-1 holds 8 + 8 + 16/4 = 20 MB there, with no bubble and no more communication.
    names = [f"l{i}" for i in range(8)]
    db = chain(8, param_bytes=dict.fromkeys(names, MB), hw=hardware(memory_bytes=20 * MB, optimizer_factor=3.0,
                                                                    link=LINK))
    zero0 = graphpipe_search(db, num_devices=4, mini_batch=8, zero_stages=(0,)).plan
    auto = graphpipe_search(db, num_devices=4, mini_batch=8, zero_stages=ZERO_STAGES).plan
    assert zero0.num_stages > 1
    assert auto.zero_stage == 1 and [(len(s.layers), s.devices) for s in auto.stages] == [(8, 4)]
    assert auto.predicted.peak_mem_bytes == pytest.approx(20 * MB)
    assert auto.predicted.iteration_time_s < zero0.predicted.iteration_time_s


def test_with_ample_memory_auto_keeps_zero_stage_0_and_zero_0s_plan():
    db = _eight_layers(1e12)
    zero0 = _search(db, (0,)).plan
    auto = _search(db, ZERO_STAGES).plan
    assert auto.zero_stage == 0 and auto.stages == zero0.stages
    assert auto.predicted.iteration_time_s == zero0.predicted.iteration_time_s
    # ZeRO-1 was as fast (same collectives) and ZeRO-2/3 slower: the lowest stage is kept.
    assert _search(db, (1,)).plan.predicted.iteration_time_s == zero0.predicted.iteration_time_s
    assert _search(db, (2,)).plan.predicted.iteration_time_s > zero0.predicted.iteration_time_s


def test_choose_zero_stage_gives_a_fixed_stage_graph_the_lowest_stage_that_fits():
    # The one-stage plan of the ZeRO-3 case: 9.8 MB under ZeRO-3, 14.8 MB under ZeRO-2.
    plan = Plan(model="synthetic", method="manual", source="hand", micro_batch=4, mini_batch=16,
                stages=(PlanStage(layers=tuple(f"l{i}" for i in range(8)), devices=4),))
    assert choose_zero_stage(plan, _eight_layers(15 * MB)).zero_stage == 2
    assert choose_zero_stage(plan, _eight_layers(10 * MB)).zero_stage == 3
    assert choose_zero_stage(plan, _eight_layers(1e12)).zero_stage == 0


def test_a_plan_file_without_zero_stage_loads_as_zero_0_and_round_trips_its_stage():
    plan = Plan(model="m", method="manual", source="hand", micro_batch=1, mini_batch=4,
                stages=(PlanStage(layers=("a",), devices=2),), zero_stage=3)
    assert Plan.from_json(plan.to_json()).zero_stage == 3
    old = json.loads(plan.to_json())
    del old["zero_stage"]
    assert Plan.from_json(json.dumps(old)).zero_stage == 0
    with pytest.raises(GPPConfigError, match="got 5"):
        Plan.from_json(json.dumps({**old, "zero_stage": 5}))


def test_zero_2_and_3_are_refused_under_an_asynchronous_schedule_and_auto_skips_them():
    plan, db = _one_stage(2, 4)
    with pytest.raises(GPPConfigError, match="ZeRO stage 0 or 1"):
        simulate_plan(plan, db, schedule="pipedream")
    with pytest.raises(GPPConfigError, match="ZeRO stage 0 or 1"):
        graphpipe_search(db, num_devices=4, mini_batch=16, schedules=("2bw",), zero_stages=(2, 3))
    found = graphpipe_search(_eight_layers(1e12), num_devices=4, mini_batch=16, micro_batches=(4,),
                             schedules=("2bw",), zero_stages=ZERO_STAGES).plan
    assert found.zero_stage in (0, 1)
