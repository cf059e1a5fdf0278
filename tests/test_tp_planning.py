"""Tensor parallelism in the planner (issue 29, point 4): pricing against a hand computation, the search
choosing a TP degree where memory forces it and not where the all-reduces cost more than they save,
plans carrying ``tp`` through JSON, and ``gpp plan --tp``."""

from __future__ import annotations

import json

import pytest

from costdbs import chain, hardware
from gpp_deepspeed.cli import main
from gpp_deepspeed.errors import GPPConfigError
from gpp_deepspeed.planner.costs import NO_BOUNDARY, CommFit, StageCostModel, allreduce_time, tensor_parallel_time
from gpp_deepspeed.planner.plan import Plan, PlanStage
from gpp_deepspeed.planner.search import graphpipe_search
from gpp_deepspeed.planner.simulate import predict


def _two_layers(*, memory: float = 1e18, link: CommFit, out_bytes: float = 10.0, param_bytes: float = 100.0):
    names = ["l0", "l1"]
    return chain(2, fwd=dict.fromkeys(names, 1.0), bwd=dict.fromkeys(names, 2.0), micro_batches=(1, 2, 4, 8),
                 param_bytes=dict.fromkeys(names, param_bytes), out_bytes=dict.fromkeys(names, out_bytes),
                 hw=hardware(memory_bytes=memory, optimizer_factor=3.0, link=link, devices_per_node=4))


def test_tp_pricing_matches_a_hand_computation():
    link = CommFit(alpha_s=1.0, beta_s_per_byte=0.01)
    cm = StageCostModel(_two_layers(link=link), 8)
    c = cm.stage(0b01, 4, 4, tp=2, boundary=NO_BOUNDARY)
    # 2 replicas of 2 ranks: 2 samples each. Compute 1 s/sample forward, 2 backward, split over 2.
    # Per pass: two ring all-reduces among 2 ranks of 10 B/sample * 2 samples: 2 * (2 * 1 + 1 * 0.01 * 20).
    per_pass = 2 * (2 * 1.0 + 2 * (2 - 1) / 2 * 0.01 * 20)
    assert tensor_parallel_time(link, 2, 20.0) == pytest.approx(per_pass)
    assert c.fwd_s == pytest.approx(2 * 1.0 / 2 + per_pass)
    assert c.bwd_s == pytest.approx(2 * 2.0 / 2 + per_pass)
    assert c.bwd_input_s == pytest.approx(2 * 1.0 / 2 + per_pass)   # TP's backward all-reduces are in I
    assert c.bwd_weight_s == pytest.approx(2 * 1.0 / 2)
    # Weight state per rank: 100 B / 2 parameters, (1 + 3) times; the gradient all-reduce over the
    # 2 replicas moves the rank's 50 B.
    assert c.weight_bytes == pytest.approx(100 / 2 * 4)
    assert c.allreduce_s == pytest.approx(allreduce_time(link, 2, 50.0))
    # tp 1 on the same 4 devices is plain data parallelism: nothing of the above.
    plain = cm.stage(0b01, 4, 4, boundary=NO_BOUNDARY)
    assert plain.fwd_s == pytest.approx(1.0) and plain.weight_bytes == pytest.approx(400)
    with pytest.raises(GPPConfigError, match="tensor-parallel degree 3"):
        cm.stage(0b01, 4, 4, tp=3)


def test_tp_options_stay_in_a_node_unless_asked_and_keep_replicas_dividing_the_micro_batch():
    db = _two_layers(link=CommFit(alpha_s=0.0, beta_s_per_byte=0.0))   # 4 devices per node
    cm = StageCostModel(db, 8, tp_degrees=(1, 2, 4, 8))
    assert cm.tp_options(8, 4) == [2, 4]            # tp 1 leaves 8 replicas for 4 samples; 8 spans nodes
    assert StageCostModel(db, 8, tp_degrees=(1, 2, 4, 8), tp_across_nodes=True).tp_options(8, 4) == [2, 4, 8]


def test_the_search_splits_a_stage_too_big_for_one_device_and_only_that_stage():
    # l0 holds 400 B of weight state at tp 1 (100 B, fp32 Adam), the memory 250 B: only tp 2 fits it;
    # l1 fits anywhere, and on 2 devices data parallelism beats tp 2 (no all-reduces per layer).
    link = CommFit(alpha_s=1e-3, beta_s_per_byte=1e-6)
    names = ["l0", "l1"]
    db = chain(2, fwd=dict.fromkeys(names, 1.0), bwd=dict.fromkeys(names, 2.0), micro_batches=(1, 2),
               param_bytes={"l0": 100, "l1": 10}, out_bytes=dict.fromkeys(names, 1),
               hw=hardware(memory_bytes=250, optimizer_factor=3.0, link=link, devices_per_node=4))
    without = graphpipe_search(db, num_devices=4, mini_batch=4, micro_batches=(2, ))
    assert without.plan is None
    found = graphpipe_search(db, num_devices=4, mini_batch=4, micro_batches=(2, ), tp_degrees=(1, 2))
    plan = found.plan
    assert plan is not None and plan.predicted.fits_memory
    tp_of = {name: s.tp for s in plan.stages for name in s.layers}
    assert tp_of["l0"] == 2 and tp_of["l1"] == 1
    assert Plan.from_json(plan.to_json()) == plan


def test_the_search_keeps_tp_1_where_the_all_reduces_cost_more_than_they_save():
    slow = CommFit(alpha_s=10.0, beta_s_per_byte=1.0)      # an all-reduce costs far more than a layer
    db = _two_layers(link=slow, out_bytes=1000)
    plan = graphpipe_search(db, num_devices=4, mini_batch=8, tp_degrees=(1, 2, 4)).plan
    assert all(s.tp == 1 for s in plan.stages)
    # Free all-reduces and one sample per batch: without TP two layers keep only 2 of the 4 devices
    # busy (4 devices find no plan); with it all 4 work, faster than the best plan on 2.
    free = _two_layers(link=CommFit(alpha_s=0.0, beta_s_per_byte=0.0), out_bytes=1000)
    assert graphpipe_search(free, num_devices=4, mini_batch=1).plan is None
    fast = graphpipe_search(free, num_devices=4, mini_batch=1, tp_degrees=(1, 2, 4)).plan
    assert any(s.tp > 1 for s in fast.stages)
    assert fast.predicted.iteration_time_s < graphpipe_search(free, num_devices=2, mini_batch=1).plan.predicted.iteration_time_s


def test_plans_carry_tp_and_old_files_load_with_tp_1():
    plan = Plan(model="m", method="manual", source="hand", micro_batch=2, mini_batch=8,
                stages=(PlanStage(layers=("l0",), devices=4, tp=2), PlanStage(layers=("l1",), devices=1)))
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.stages[0].replicas == 2 and "x4 (tp 2)" in again.describe()
    old = json.loads(plan.to_json())
    for s in old["stages"]:
        del s["tp"]
    assert [s.tp for s in Plan.from_json(json.dumps(old)).stages] == [1, 1]
    with pytest.raises(GPPConfigError, match="tensor-parallel degree 3 must divide its 4 devices"):
        PlanStage(layers=("l0",), devices=4, tp=3)


def test_the_simulator_prices_a_plans_tp_as_the_cost_model_does():
    link = CommFit(alpha_s=1.0, beta_s_per_byte=0.01)
    db = _two_layers(link=link)
    plan = Plan(model=db.model, method="manual", source="hand", micro_batch=4, mini_batch=8,
                stages=(PlanStage(layers=("l0",), devices=4, tp=2), PlanStage(layers=("l1",), devices=1)))
    predicted = predict(plan, db).predicted
    cm = StageCostModel(db, 8, p2p_devices=5)
    assert predicted.stage_mem_bytes[0] == pytest.approx(cm.stage(0b01, 4, 4, tp=2).memory(2))


def test_gpp_plan_tp_prints_the_choice_in_the_deepspeed_config(tmp_path, capsys):
    link = CommFit(alpha_s=1e-3, beta_s_per_byte=1e-6)
    names = ["l0", "l1"]
    db = chain(2, fwd=dict.fromkeys(names, 1.0), bwd=dict.fromkeys(names, 2.0), micro_batches=(1, 2),
               param_bytes={"l0": 100, "l1": 10}, out_bytes=dict.fromkeys(names, 1),
               hw=hardware(memory_bytes=250, optimizer_factor=3.0, link=link, devices_per_node=4))
    costs, path = tmp_path / "costs.json", tmp_path / "plan.json"
    db.save(costs)
    argv = ["plan", str(costs), "--devices", "4", "--mini-batch", "4", "--micro-batches", "1", "--quiet"]
    assert main(argv) == 2 and "found no plan" in capsys.readouterr().err
    assert main([*argv, "--tp", "auto", "-o", str(path)]) == 0
    out = capsys.readouterr().out
    plan = Plan.load(path)
    stage_tp = [s.tp for s in plan.stages]
    assert 2 in stage_tp and f'"graph_pipeline": {{"stage_tp": {stage_tp}}}' in out and "(tp 2)" in out
    assert main([*argv, "--tp", "1,2"]) == 0
    assert main([*argv, "--tp", "0"]) == 2
    assert 'positive tensor-parallel degrees like 1,2,4, got "0"' in capsys.readouterr().err
