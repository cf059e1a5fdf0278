"""The golden test: pipelined training equals single-device training, exactly.

Every case trains on real gloo processes (``tests/workers/train_cases.py``) for 3 steps of 4
micro-batches and evaluates one batch; the per-step losses, the eval loss and every final parameter
must equal :func:`reference.train_reference` (GraphModel + SGD on one process, same micro-batches)
to ``rtol=1e-5`` in fp32.
"""

import pytest
import torch

from costdbs import synthetic_db
from gpp_deepspeed.graph import build_layer_graph
from gpp_deepspeed.graph.stages import derive_partition
from gpp_deepspeed.planner.plan import Plan, PlanStage
from gpp_deepspeed.planner.simulate import simulate_plan
from gpp_deepspeed.schedule import build_program
from models import MODELS as MODEL_CASES, make_batches
from reference import train_reference

pytestmark = pytest.mark.dist

MODELS = ["chain", "diamond", "four_branch", "skip", "fanout3", "three_input"]
# Models whose shape is forced by an explicit partition at this stage count (see tests/models.py).
EXPLICIT = {2: {"glue_out"}, 3: {"skip", "fanout3", "late_input"}, 4: {"diamond", "skip", "fanout3", "tied", "varlen"}}
BASE = {"steps": 3, "mbs": 4, "gas": 4, "lr": 0.1}


def case(model, stages, zero, **extra):
    partition = "explicit" if model in EXPLICIT.get(stages, ()) else "uniform"
    name = f"{model}-s{stages}-z{zero}" + "".join(f"-{k}" + (f"_{extra[k]}" if k == "schedule" else "")
                                                  for k in sorted(extra) if k != "partition")
    if "partition" in extra:  # a partition method of its own: a case of its own
        name += "-" + ("plan" if extra["partition"].endswith(".json") else extra["partition"])
    return {"id": name, "model": model, "stages": stages, "zero": zero, "partition": partition, **BASE, **extra}


def golden(stages):
    return [case(m, stages, z) for m in MODELS for z in (0, 1)]


# Stages without parameters (glue only), under every partition method, SGD and DeepSpeed's Adam,
# ZeRO-0 and ZeRO-1, a glue loss stage in pipe 2 x data 2, and the zero-bubble schedules.
GLUE = [case("glue", 4, 0, partition="uniform"), case("glue", 4, 1, partition="parameters"),
        case("glue", 4, 0, partition="sequential", optimizer="adam", lr=0.01),
        case("glue", 4, 1, partition="graphpipe", optimizer="adam", lr=0.01),
        case("glue_out", 4, 1, partition="sequential"), case("glue_out", 4, 0, partition="uniform", optimizer="adam",
                                                              lr=0.01),
        case("glue_out", 2, 1, optimizer="adam", lr=0.01), case("glue", 4, 1, schedule="zb1"),
        case("glue_out", 4, 0, schedule="zb2")]
# training_data=: DeepSpeed's loader on every stage that reads the batch (middle stages 1 and 2 read
# graph inputs here), and data-parallel shards (pipe 2 x data 2).
DATA = [case("three_input", 4, 0, training_data=True), case("three_input", 2, 1, training_data=True)]
# A middle stage (1 of 3) reads a graph input besides what stage 0 sends it.
LATE = [case("late_input", 3, 0), case("late_input", 3, 1, schedule="zb1")]
# Fuzzed DAGs (tests/fuzz_models.py, fixed seeds): branches, skips across stages, tuple outputs,
# 1-3 inputs, boolean and integer tensors crossing stages without gradients, random valid partitions
# (a case id names its seed: rerun it alone with that id).
FUZZ = {2: [case("fuzz:0", 2, 0, partition="explicit")],
        3: [case("fuzz:1", 3, 1, partition="explicit"), case("fuzz:2", 3, 0, partition="explicit")],
        4: [case(f"fuzz:{seed}", 4, seed % 2, partition="explicit") for seed in (3, 4, 5, 6)]
        + [case("fuzz:7", 2, 1, partition="explicit"), case("fuzz:8", 4, 0, partition="parameters"),
           case("fuzz:9", 4, 1, partition="sequential")]}
# Recomputation under the split backward (torch's non-reentrant checkpoint, recomputing in I and W):
# every layer its own chunk, two-layer chunks in pipe 2 x data 2, and a plan's per-stage recompute mark.
RECOMPUTE_ZB = [case("four_branch", 4, 0, ckpt_interval=1, schedule="zb1"),
                case("skip", 2, 1, ckpt_interval=2, schedule="zb2"),
                case("four_branch", 4, 0, partition="golden/plan_four_branch_s4_recompute.json", recompute=4,
                     schedule="zb1")]
# Zero-bubble schedules (split backward, I then W): DAG shapes of the golden test, ZeRO-0/1, pipe x data.
WORLDS = {
    2: golden(2) + [case("chain", 2, 1, schedule="zb2")] + FUZZ[2],
    3: golden(3) + [case("diamond", 3, 0, schedule="zb1"), case("fanout3", 3, 1, schedule="zb2"),
                    case("skip", 3, 0, partition="sequential")]  # a chain: l1 relayed through stage 1
    + LATE + FUZZ[3],
    4: golden(4) + [case(m, 2, z) for m in ("four_branch", "skip") for z in (0, 1)]  # pipe 2 x data 2
    + [case("four_branch", 4, 1, partition="parameters"), case("three_input", 4, 1, partition="sequential"),
       case("skip", 4, 1, clip=0.05), case("four_branch", 4, 0, ckpt_interval=1),
       case("fanout3", 4, 1, schedule="gpipe"), case("tied", 4, 0), case("tied", 4, 1),
       case("varlen", 4, 1),  # dynamic_shape: activation shapes change every micro-batch
       case("four_branch", 4, 1, partition="graphpipe"),  # GraphPipe's search on every rank
       case("four_branch", 4, 0, partition="golden/plan_four_branch_s4.json"),  # a plan file
       case("skip", 4, 1, partition="golden/plan_skip_chain_s4.json"),  # a chain plan: l1 relayed twice
       case("four_branch", 4, 1, schedule="zb1"), case("skip", 4, 0, schedule="zb2"),
       case("three_input", 4, 0, schedule="zb2"), case("tied", 4, 1, schedule="zb1"),
       case("four_branch", 2, 0, schedule="zb1"), case("skip", 2, 1, schedule="zb2"),  # pipe 2 x data 2
       case("four_branch", 4, 1, partition="golden/plan_four_branch_s4_zb1.json"),  # runs the plan's zb1
       # the plan marks stage 2 (four layers) to recompute: checkpointing there only
       case("four_branch", 4, 0, partition="golden/plan_four_branch_s4_recompute.json", recompute=4)]
    + RECOMPUTE_ZB
    + GLUE + DATA + FUZZ[4],
}
# The schedule each case must have run: the config's, else its plan file's, else 1f1b.
PLAN_SCHEDULES = {"golden/plan_four_branch_s4_zb1.json": "zb1"}
ALL = [(world, c) for world, cases in WORLDS.items() for c in cases]


def _load(out, c, world):
    return [torch.load(out / f"{c['id']}.rank{r}.pt") for r in range(world)]


@pytest.mark.parametrize("world,c", ALL, ids=[f"w{w}-{c['id']}" for w, c in ALL])
def test_pipeline_training_matches_single_device_model(run_cases, world, c):
    out = run_cases(f"golden_w{world}", world, WORLDS[world])
    ranks = _load(out, c, world)
    dp = world // c["stages"]
    ref = train_reference(c, dp=dp)
    for r, res in enumerate(ranks):
        assert res["schedule"] == c.get("schedule", PLAN_SCHEDULES.get(c["partition"], "1f1b"))
        assert res["losses"] == pytest.approx(ref.losses, rel=1e-5), f"rank {r} (stage {res['stage']})"
        assert res["eval"] == pytest.approx(ref.eval_loss, rel=1e-5), f"rank {r} (stage {res['stage']})"
        if "recompute" in c:
            assert res["ckpt_interval"] == (c["recompute"] if res["stage"] == 2 else 0), f"rank {r}"
        if res["ckpt_interval"] and c.get("schedule") in ("zb1", "zb2"):
            assert res["ckpt_func"] == "recompute", f"rank {r}: the split backward recomputes non-reentrantly"
    logits = {res["dp"]: res["logits"] for res in ranks if res["logits"] is not None}
    assert sorted(logits) == list(range(dp)), "the output stage of every replica returns logits"
    for d, value in logits.items():
        torch.testing.assert_close(value, ref.last_logits[d], rtol=1e-5, atol=1e-6)
    seen = set()
    for res in ranks:
        for name, value in res["state"].items():
            torch.testing.assert_close(value, ref.state[name], rtol=1e-5, atol=1e-6, msg=name)
            seen.add(name)
    assert seen == set(ref.state), "every parameter lives on exactly the stages that own it"


@pytest.mark.parametrize("c", GLUE, ids=[c["id"] for c in GLUE])
def test_glue_cases_have_a_stage_without_parameters(run_cases, c):
    ranks = _load(run_cases("golden_w4", 4, WORLDS[4]), c, 4)
    assert any(not res["state"] for res in ranks), [sorted(res["state"]) for res in ranks]


@pytest.mark.parametrize("c", DATA, ids=[c["id"] for c in DATA])
def test_training_data_feeds_each_pipeline_the_same_samples_and_each_replica_its_own_shard(run_cases, c):
    ranks = _load(run_cases("golden_w4", 4, WORLDS[4]), c, 4)
    mc = MODEL_CASES[c["model"]]()
    for res in ranks:
        # DeepSpeed's loader (a DistributedSampler over replicas, unshuffled) on ReplicaOrderedDataset
        # gives replica d the micro-batches make_batches gives it, in order.
        expected = [(list(x) if isinstance(x, tuple) else [x], y) for step in range(c["steps"])
                    for x, y in make_batches(mc, step=step, dp_rank=res["dp"], micro_batches=c["gas"],
                                             micro_batch_size=c["mbs"])]
        if res["seen"]:
            assert len(res["seen"]) == len(expected), f"stage {res['stage']}"
            for (xs, y), (ex, ey) in zip(res["seen"], expected):
                assert torch.equal(y, ey) and all(torch.equal(a, b) for a, b in zip(xs, ex)), f"stage {res['stage']}"
    readers = sorted(res["stage"] for res in ranks if res["seen"] and res["dp"] == 0)
    assert readers == list(range(c["stages"])), "every stage of this model reads the batch"


@pytest.mark.parametrize("c", LATE, ids=[c["id"] for c in LATE])
def test_a_middle_stage_reading_a_graph_input_runs_the_program_the_simulator_prices(run_cases, c):
    """The stage graph says which stages load the batch, once: the engine, the program and the
    planner's simulator agree on a stage that has a predecessor and reads a graph input."""
    ranks = _load(run_cases("golden_w3", 3, WORLDS[3]), c, 3)
    layers = [("px", ["x"]), ("py", ["y"]), ("mix", ["px", "py"]), ("body", ["mix"]), ("head", ["body"])]
    stage_of = MODEL_CASES["late_input"]().partitions[3]
    stage_graph = derive_partition(build_layer_graph(["x", "y"], layers), stage_of, num_stages=3).stage_graph
    assert stage_graph.preds(1) == [0] and stage_graph.loading == {0, 1, 2}
    program = build_program(stage_graph, c["gas"], schedule=c.get("schedule", "1f1b"))
    plan = Plan(model="late_input", method="manual", source="test", micro_batch=c["mbs"], mini_batch=c["mbs"] * c["gas"],
                stages=tuple(PlanStage(layers=tuple(n for n, _ in layers if stage_of[n] == s)) for s in range(3)),
                schedule=c.get("schedule", "1f1b"))
    priced = simulate_plan(plan, synthetic_db(layers, inputs=("x", "y"))).schedule
    for res in ranks:
        s = res["stage"]
        assert res["actions"] == [str(a) for a in program.actions[s]] == [str(a) for a in priced[s]], f"stage {s}"
        assert f"{s}LOAD0" in res["actions"], f"stage {s} reads the batch"


def test_zero_bubble_with_recomputation_computes_what_1f1b_with_recomputation_computes(run_cases):
    out = run_cases("golden_w4", 4, WORLDS[4])
    zb, one_f_one_b = RECOMPUTE_ZB[0], case("four_branch", 4, 0, ckpt_interval=1)
    for zb_rank, ref_rank in zip(_load(out, zb, 4), _load(out, one_f_one_b, 4)):
        assert zb_rank["ckpt_interval"] == ref_rank["ckpt_interval"] == 1
        assert zb_rank["losses"] == pytest.approx(ref_rank["losses"], rel=1e-6)
        for name, value in zb_rank["state"].items():
            torch.testing.assert_close(value, ref_rank["state"][name], rtol=1e-6, atol=1e-7, msg=name)
