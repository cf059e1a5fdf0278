"""DeepSpeed features through the graph engine: checkpoints, the drop-in path, bf16, logging and
traces."""

import json
import re

import pytest
import torch

from reference import train_reference
from test_equivalence import case

pytestmark = pytest.mark.dist

CKPT = [case("four_branch", 4, 1, checkpoint=True), case("four_branch", 2, 0, checkpoint=True),
        case("tied", 4, 1, checkpoint=True)]
DROP_IN = [case("chain", 4, z, clip=0.0, **extra) for z in (0, 1) for extra in ({}, {"deepspeed_module": True})]
BF16 = [case("four_branch", 4, 1, bf16=True), case("skip", 4, 1, bf16=True),
        # stages without parameters: a middle one under ZeRO-1, the loss stage under ZeRO-0
        case("glue", 4, 1, bf16=True, partition="sequential"), case("glue_out", 4, 0, bf16=True, partition="uniform")]
TRACED = case("four_branch", 4, 1, trace=True, steps_per_print=1, wall_clock=True)
# The split backward under bf16 (DeepSpeed's low/high-precision gradient hand-off after every W) and
# under wall_clock_breakdown (DeepSpeed's backward timers started by I, stopped around W).
ZB_BF16 = case("four_branch", 4, 1, bf16=True, schedule="zb1")
ZB_TIMED = case("skip", 4, 0, wall_clock=True, schedule="zb2")
# A float64 model (its layers cast before initialize), without clipping (its norm is summed in float32).
FLOAT64 = case("four_branch", 4, 0, float64=True, clip=0.0)
# DeepSpeed's automatic-collector switch with the engine's collections between batches; last in the
# launch, since the collector is the process's (the worker turns it on again after the case).
GC_BETWEEN_BATCHES = case("four_branch", 4, 1, disable_python_gc=True, gc_interval=2, steps=4)
# The activation meter (graph_pipeline.activation_meter_steps) left at its default, measuring until
# the steady program, against the same run measuring every step: synchronous (one step), asynchronous
# (PipeDream's first batches fill the pipeline) and micro-batches that change shape (every step).
EVERY_STEP = {"activation_meter_steps": "every_step"}
METERED = {name: [case(model, 4, 0, steps=steps, **extra, **more) for more in ({}, EVERY_STEP)]
           for name, model, steps, extra in (("sync", "four_branch", 3, {}),
                                             ("async", "four_branch", 5, {"schedule": "pipedream", "clip": 0.0}),
                                             ("dynamic", "varlen", 3, {}))}
CASES = CKPT + DROP_IN + BF16 + [TRACED, ZB_BF16, ZB_TIMED, FLOAT64] + [c for pair in METERED.values() for c in pair] \
    + [GC_BETWEEN_BATCHES]


@pytest.fixture(scope="module")
def out(run_cases):
    return run_cases("runtime_w4", 4, CASES)


def ranks(out, c):
    return [torch.load(out / f"{c['id']}.rank{r}.pt") for r in range(4)]


@pytest.mark.parametrize("c", CKPT, ids=[c["id"] for c in CKPT])
def test_checkpoint_resume_continues_exactly_like_an_uninterrupted_run(out, c):
    for res in ranks(out, c):
        assert res["resumed"] == res["uninterrupted"]
    ref = train_reference(c, dp=4 // c["stages"], steps=range(4))
    assert ranks(out, c)[0]["uninterrupted"] == pytest.approx(ref.losses[2:], rel=1e-5)


@pytest.mark.parametrize("zero", [0, 1])
def test_unchanged_deepspeed_layer_list_trains_like_pipeline_module(out, zero):
    ours = [case("chain", 4, zero, clip=0.0), case("chain", 4, zero, clip=0.0, deepspeed_module=True)]
    graph, deepspeed_run = (ranks(out, c) for c in ours)
    for r in range(4):
        assert graph[r]["losses"] == pytest.approx(deepspeed_run[r]["losses"], rel=1e-6)
        assert graph[r]["eval"] == pytest.approx(deepspeed_run[r]["eval"], rel=1e-6)


@pytest.mark.parametrize("c", BF16, ids=[c["id"] for c in BF16])
def test_bf16_training_tracks_the_fp32_single_device_model(out, c):
    ref = train_reference(c, dp=1)
    for res in ranks(out, c):
        # bf16 keeps 8 mantissa bits: agreement to a few percent is what bf16 can promise.
        assert res["losses"] == pytest.approx(ref.losses, rel=3e-2)
        assert res["eval"] == pytest.approx(ref.eval_loss, rel=3e-2)


def test_bf16_zero_bubble_training_computes_what_bf16_1f1b_computes(out):
    # Same gradients per micro-batch, handed to DeepSpeed's fp32 accumulators in the same order.
    one_f_one_b = {res["stage"]: res for res in ranks(out, BF16[0])}
    for res in ranks(out, ZB_BF16):
        assert res["schedule"] == "zb1"
        assert res["losses"] == pytest.approx(one_f_one_b[res["stage"]]["losses"], rel=1e-6)
        for name, value in res["state"].items():
            torch.testing.assert_close(value, one_f_one_b[res["stage"]]["state"][name], rtol=1e-6, atol=0)


def test_zero_bubble_runs_under_deepspeeds_wall_clock_breakdown(out):
    # DeepSpeed's timers assert on a start without a stop: I starts them, W's epilogue stops them.
    ref = train_reference(ZB_TIMED, dp=1)
    for res in ranks(out, ZB_TIMED):
        assert res["losses"] == pytest.approx(ref.losses, rel=1e-5)


def test_a_traced_run_writes_each_ranks_instructions_and_logs_idle_fractions(out):
    c = TRACED
    ref = train_reference(c, dp=1)
    for r, res in enumerate(ranks(out, c)):
        assert res["losses"] == pytest.approx(ref.losses, rel=1e-5), "tracing changes nothing"
        events = json.loads((out / f"trace_{c['id']}" / f"rank{r}.json").read_text())["traceEvents"]
        names = [e["name"] for e in events]
        stage = res["stage"]
        # every micro-batch of every step: one forward and one backward, in program order
        assert names.count(f"{stage}F0") == c["steps"] and sum(n.startswith(f"{stage}F") for n in names) == \
            c["steps"] * c["gas"]
        assert sum(n.startswith(f"{stage}B") for n in names) == c["steps"] * c["gas"]
        starts = [e["ts"] for e in events]
        assert starts == sorted(starts) and all(e["dur"] > 0 and e["tid"] == stage for e in events)
        # one stage runs one instruction at a time: each span ends before the next begins (0.001 us of rounding)
        assert all(a["ts"] + a["dur"] <= b["ts"] + 1e-3 for a, b in zip(events, events[1:]))
    log = (out / "logs" / "rank0.log").read_text()
    lines = re.findall(r"steps: (\d+) graph pipeline idle per stage: ((?:\d+:\d+% ?)+)", log)
    assert [int(step) for step, _ in lines] == list(range(1, c["steps"] + 1))
    for _, shown in lines:
        fractions = [int(x.split(":")[1].rstrip("%")) for x in shown.split()]
        assert len(fractions) == 4 and all(0 <= f < 100 for f in fractions)
    # DeepSpeed's wall_clock_breakdown reports our edge transfers under its own pipe timers
    assert "pipe_send_output" in log and "pipe_recv_grad" in log and "bwd_microstep" in log


def test_gpp_viz_run_draws_the_measured_schedule_of_a_traced_step(out, tmp_path):
    from gpp_deepspeed.cli import main
    from gpp_deepspeed.viz import timeline_from_traces

    c = TRACED
    timeline, step = timeline_from_traces(out / f"trace_{c['id']}")
    assert step == c["steps"] and sorted(timeline.spans) == [0, 1, 2, 3]
    for stage, spans in timeline.spans.items():
        assert sum(a.kind.value == "F" for a, _, _ in spans) == c["gas"]
    assert main(["viz-run", str(out / f"trace_{c['id']}"), "-o", str(tmp_path), "--quiet"]) == 0
    assert (tmp_path / "gantt_run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_float64_model_trains_in_float64_and_its_losses_come_back_in_float64(out):
    ref = train_reference(FLOAT64, dp=1)
    for res in ranks(out, FLOAT64):
        assert res["loss_dtype"] == res["eval_dtype"] == "torch.float64"
        # float32 anywhere on the way would leave ~1e-7 of relative error
        assert res["losses"] == pytest.approx(ref.losses, rel=1e-12)
        assert res["eval"] == pytest.approx(ref.eval_loss, rel=1e-12)


def test_with_disable_python_gc_every_rank_collects_only_between_batches_every_gc_interval_steps(out):
    # A cyclic collection inside a batch stalls every rank that waits for the collecting one; with
    # DeepSpeed's "disable_python_gc" and gc_interval 2 none starts inside a batch, and each rank
    # collects after steps 2 and 4. The start-up heap is frozen (gc_freeze, the default), and the
    # model trains as on one device.
    ref = train_reference(GC_BETWEEN_BATCHES, dp=1)
    for res in ranks(out, GC_BETWEEN_BATCHES):
        watched = res["gc"]
        assert watched["enabled"] is False and watched["frozen"] > 0
        assert [s["automatic"] for s in watched["steps"]] == [0, 0, 0, 0]
        assert [s["asked"] for s in watched["steps"]] == [0, 1, 0, 1]
        assert res["losses"] == pytest.approx(ref.losses, rel=1e-5)


def test_the_activation_peak_measured_until_the_steady_program_is_the_peak_of_every_step(out):
    for name, (metered, every) in METERED.items():
        for r in range(4):
            until, always = ranks(out, metered)[r]["meter"], ranks(out, every)[r]["meter"]
            assert [steps for _, steps in always] == [1, 2, 3, 4, 5][:len(always)]
            assert until[-1][0] == always[-1][0] > 0, (name, r)
    sync, asynchronous, dynamic = ([steps for _, steps in ranks(out, METERED[n][0])[0]["meter"]]
                                   for n in ("sync", "async", "dynamic"))
    assert sync == [1, 1, 1]              # then forwards run without the saved-tensor hooks
    assert 1 < asynchronous[-1] < 5       # PipeDream's steady batch, after the batches that fill it
    assert dynamic == [1, 2, 3]           # shapes change: every step


def test_the_memory_report_after_step_1_says_which_steps_its_activation_peak_covers(out):
    log = (out / "logs" / "rank0.log").read_text()
    assert "activation peak (of step 1), their sum" in log
