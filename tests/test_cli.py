"""The ``gpp`` command line: profile, plan, simulate and compare, on synthetic and paper cost databases.

Most tests call :func:`gpp_deepspeed.cli.main` in this process; one runs the installed script.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from costdbs import branches, chain, hardware
from gpp_deepspeed.cli import _parser, main
from gpp_deepspeed.planner import CommFit, CostDB, Plan, simulate_plan

DEVICES, MINI_BATCH = "4", "16"


@pytest.fixture
def costs(tmp_path) -> Path:
    """Four branches of two layers and a join; the memory holds four layers' weights at most, so
    every planner needs several stages."""
    names = [f"b{b}_{i}" for b in range(4) for i in range(2)]
    db = branches(4, 2, fwd=dict.fromkeys(names + ["cat"], 1e-3), bwd=dict.fromkeys(names + ["cat"], 2e-3),
                  param_bytes=dict.fromkeys(names, 1e7), out_bytes=dict.fromkeys(names, 1e3),
                  stash_bytes=dict.fromkeys(names, 1e4),
                  hw=hardware(memory_bytes=2e8, optimizer_factor=3.0,
                              link=CommFit(alpha_s=1e-5, beta_s_per_byte=1e-9)))
    path = tmp_path / "costs.json"
    db.save(path)
    return path


@pytest.fixture
def plan_file(costs, tmp_path, capsys) -> Path:
    path = tmp_path / "plan.json"
    assert gpp("plan", costs, "--devices", DEVICES, "--mini-batch", MINI_BATCH, "-o", path, "--quiet") == 0
    capsys.readouterr()
    return path


def gpp(*argv) -> int:
    return main([str(a) for a in argv])


def test_gpp_plan_writes_a_plan_that_plan_load_reads_and_that_covers_every_layer(costs, plan_file):
    plan = Plan.load(plan_file)
    layers = [name for stage in plan.stages for name in stage.layers]
    assert sorted(layers) == sorted(CostDB.load(costs).by_name)
    assert plan.mini_batch == int(MINI_BATCH) and plan.num_devices <= int(DEVICES)


def test_gpp_plan_json_parses_and_reports_the_predicted_iteration_time(costs, capsys):
    assert gpp("plan", costs, "--devices", DEVICES, "--mini-batch", MINI_BATCH, "--json", "--quiet") == 0
    out = json.loads(capsys.readouterr().out)
    assert out["iteration_time_s"] > 0 and out["status"] == "ok"
    assert Plan.from_json(json.dumps(out["plan"])).predicted.iteration_time_s == out["iteration_time_s"]


def test_gpp_plan_prints_progress_on_stderr_unless_quiet(costs, capsys):
    argv = ["plan", costs, "--devices", DEVICES, "--mini-batch", MINI_BATCH, "--space", "runtime"]
    assert gpp(*argv) == 0
    captured = capsys.readouterr()
    assert "graphpipe: micro-batch 16" in captured.err and "graphpipe: micro-batch" not in captured.out
    assert "to run it: GraphPipelineModule(" in captured.out
    assert gpp(*argv, "--quiet") == 0
    assert capsys.readouterr().err == ""


def test_gpp_simulate_prints_one_row_per_stage(costs, plan_file, capsys):
    assert gpp("simulate", plan_file, "--costs", costs) == 0
    lines = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("-----")) + 1
    rows = [line.split() for line in lines[start:] if line.strip() and line.split()[0].isdigit()]
    num_stages = Plan.load(plan_file).num_stages
    assert num_stages > 1 and [int(r[0]) for r in rows] == list(range(num_stages))


def test_gpp_simulate_json_equals_the_simulators_prediction(costs, plan_file, capsys):
    assert gpp("simulate", plan_file, "--costs", costs, "--json") == 0
    out = json.loads(capsys.readouterr().out)
    expected = simulate_plan(Plan.load(plan_file), CostDB.load(costs)).prediction
    for field in expected.__dataclass_fields__:
        value = getattr(expected, field)
        assert out[field] == (list(value) if isinstance(value, tuple) else value), field
    assert len(out["stages"]) == len(expected.stage_busy_s)


def test_gpp_compare_json_gives_one_row_per_method_and_piper_plans_a_tiny_db(costs, capsys):
    methods = ["graphpipe", "pipedream", "piper", "ds-uniform", "ds-parameters"]
    assert gpp("compare", costs, "--devices", DEVICES, "--mini-batch", MINI_BATCH, "--json", "--quiet") == 0
    out = json.loads(capsys.readouterr().out)
    rows = {r["method"]: r for r in out["rows"]}
    assert list(rows) == methods
    keys = {"method", "iteration_time_s", "samples_per_s", "peak_mem_bytes", "search_time_s", "status"}
    assert all(keys <= set(row) for row in rows.values())
    assert rows["piper"]["status"] == "ok" and rows["piper"]["samples_per_s"] > 0
    assert out["source"] == "synthetic (tests)" and out["speedup_vs"].startswith("best baseline")


def test_gpp_compare_table_names_the_cost_source_and_the_speedup_reference(costs, capsys):
    assert gpp("compare", costs, "--devices", DEVICES, "--mini-batch", MINI_BATCH, "--methods", "graphpipe",
               "--quiet") == 0
    out = capsys.readouterr().out
    assert "costs: synthetic (tests)" in out and "relative to graphpipe" in out
    assert "1.00x" in out


def test_gpp_profile_analytic_writes_a_cost_db_whose_source_says_analytic(tmp_path, capsys):
    path = tmp_path / "mmt.json"
    assert gpp("profile", "mmt", "--analytic", "v100", "-o", path) == 0
    db = CostDB.load(path)
    assert db.source.startswith("analytic: V100") and len(db.layers) == 34
    assert "analytic" in capsys.readouterr().out


def test_gpp_profile_size_overrides_a_builder_argument(tmp_path, capsys):
    path = tmp_path / "mmt.json"
    assert gpp("profile", "mmt", "--tiny", "--analytic", "a100", "--size", "branches=2",
               "--granularity", "sublayer", "-o", path, "--json") == 0
    db = CostDB.load(path)
    assert db.granularity == "sublayer" and len(db.input_names) == 2
    assert json.loads(capsys.readouterr().out)["layers"] == len(db.layers)


def test_gpp_profile_measures_tiny_candle_uno_on_the_cpu(tmp_path, capsys):
    pytest.importorskip("torch")
    path = tmp_path / "candle.json"
    assert gpp("profile", "candle", "--tiny", "--micro-batches", "1,2", "--no-link-measure", "--device", "cpu",
               "-o", path, "--quiet") == 0
    db = CostDB.load(path)
    assert db.model == "candle_uno" and db.micro_batches == (1, 2) and db.source.startswith("measured on cpu")
    assert all(f > 0 for c in db.layers for f in c.fwd_s) and "links not measured" in db.hardware.name


@pytest.mark.parametrize("argv, words", [
    (["profile", "resnet", "--analytic", "v100", "-o", "x.json"], ['unknown model "resnet"', "candle_uno", "mmt"]),
    (["plan", "missing.json", "--devices", "4", "--mini-batch", "16"], ['"missing.json" does not exist']),
    (["plan", "COSTS", "--devices", "0", "--mini-batch", "16"], ["--devices", "positive integer", "'0'"]),
    (["plan", "COSTS", "--devices", "4", "--mini-batch", "16", "--method", "alpa"], ['unknown method "alpa"']),
    (["simulate", "missing.json", "--costs", "COSTS"], ['plan "missing.json" does not exist']),
    (["plan", "COSTS", "--devices", "4", "--mini-batch", "16", "--micro-batches", "3"], ["found no plan"]),
])
def test_gpp_bad_input_exits_2_with_a_message_naming_the_problem(costs, tmp_path, monkeypatch, capsys, argv,
                                                                  words):
    monkeypatch.chdir(tmp_path)
    assert gpp(*[str(costs) if a == "COSTS" else a for a in argv]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for word in words:
        assert word in err, err


def test_gpp_compare_shows_graphpipes_best_plan_under_each_schedule_and_prices_the_baselines_under_each(costs, capsys):
    assert gpp("compare", costs, "--devices", DEVICES, "--mini-batch", MINI_BATCH, "--methods", "graphpipe,ds-uniform",
               "--schedules", "1f1b,zb1,zb2", "--json", "--quiet") == 0
    rows = {r["method"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert sorted(rows) == ["ds-uniform/1f1b", "ds-uniform/zb1", "ds-uniform/zb2",
                            "graphpipe/1f1b", "graphpipe/zb1", "graphpipe/zb2"]
    # GraphPipe searched under each schedule: a schedule's row is at least as fast as the 1F1B
    # row's plan would be under it, and the split backward never slower than 1F1B here.
    assert rows["graphpipe/zb1"]["iteration_time_s"] <= rows["graphpipe/1f1b"]["iteration_time_s"]
    assert rows["graphpipe/zb2"]["iteration_time_s"] <= rows["graphpipe/zb1"]["iteration_time_s"]
    # the baseline's one plan, priced three ways
    assert len({rows[f"ds-uniform/{s}"]["stages"] for s in ("1f1b", "zb1", "zb2")}) == 1


def test_gpp_plan_keeps_the_fastest_schedule_and_the_plan_file_carries_it(costs, tmp_path, capsys):
    path = tmp_path / "plan.json"
    assert gpp("plan", costs, "--devices", DEVICES, "--mini-batch", MINI_BATCH, "--schedules", "1f1b,zb1",
               "-o", path, "--quiet") == 0
    plan = Plan.load(path)
    assert plan.schedule == "zb1" and "schedule zb1" in capsys.readouterr().out
    assert gpp("plan", costs, "--devices", DEVICES, "--mini-batch", MINI_BATCH, "--schedules", "zb9",
               "--quiet") == 2
    assert 'unknown schedule "zb9"' in capsys.readouterr().err


def test_gpp_subcommands_and_options_are_frozen():
    # Adding or renaming an option is a deliberate change: update this list with it.
    sub = next(a for a in _parser()._actions if isinstance(a.choices, dict))
    options = {name: sorted(o for a in p._actions for o in a.option_strings if o.startswith("--"))
               for name, p in sub.choices.items()}
    common = ["--help", "--json", "--quiet"]
    search = sorted(common + ["--devices", "--fold", "--mini-batch", "--micro-batches", "--recompute", "--schedules",
                              "--space"])
    assert options == {
        "profile": sorted(common + ["--analytic", "--device", "--granularity", "--micro-batches",
                                    "--no-link-measure", "--output", "--size", "--tiny"]),
        "plan": sorted(search + ["--cluster", "--method", "--objective", "--output", "--topology", "--tp",
                                 "--tp-across-nodes", "--zero"]),
        "simulate": sorted(common + ["--costs"]),
        "viz": sorted(common + ["--costs", "--format", "--output-dir"]),
        "viz-run": sorted(common + ["--step", "--format", "--output-dir"]),
        "compare": sorted(search + ["--methods"]),
    }


def test_the_installed_gpp_script_prints_help():
    script = Path(sys.executable).parent / "gpp"
    if not script.exists():
        pytest.skip(f"{script} is not installed: pip install -e .")
    proc = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    for command in ("profile", "plan", "simulate", "compare"):
        assert command in proc.stdout


def test_gpp_plan_defaults_to_the_full_space_and_prints_the_launch_and_batch_values_that_run_it(costs, tmp_path,
                                                                                                  capsys):
    path = tmp_path / "full.json"
    assert gpp("plan", costs, "--devices", DEVICES, "--mini-batch", MINI_BATCH, "-o", path, "--quiet") == 0
    out = capsys.readouterr().out
    plan = Plan.load(path)
    assert f"deepspeed --num_gpus {plan.num_devices}" in out and f"on {plan.num_devices} ranks" in out
    assert (f'"train_batch_size": {plan.mini_batch}, "train_micro_batch_size_per_gpu": {plan.micro_batch}, '
            f'"gradient_accumulation_steps": {plan.num_microbatches}') in out
    assert "not runnable" not in out


def test_gpp_compare_prices_the_asynchronous_schedules_in_steady_state(costs, capsys):
    assert gpp("compare", costs, "--devices", DEVICES, "--mini-batch", MINI_BATCH, "--methods", "graphpipe",
               "--schedules", "1f1b,pipedream,2bw,pipeoptim", "--json", "--quiet") == 0
    rows = {r["method"].split("/")[1]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert sorted(rows) == ["1f1b", "2bw", "pipedream", "pipeoptim"]
    # No warm-up and no flush in a steady batch: never slower than 1F1B's batch; weight versions
    # cost memory (one per micro-batch in flight for PipeDream and PipeOptim, two for 2BW).
    for name in ("pipedream", "2bw", "pipeoptim"):
        assert rows[name]["iteration_time_s"] <= rows["1f1b"]["iteration_time_s"] + 1e-12
        assert rows[name]["peak_mem_bytes"] > rows["1f1b"]["peak_mem_bytes"]
    assert rows["pipedream"]["peak_mem_bytes"] == rows["pipeoptim"]["peak_mem_bytes"]


def test_gpp_plan_zero_auto_partitions_where_memory_binds_and_prints_the_stage_in_the_deepspeed_config(tmp_path,
                                                                                                       capsys):
    # Eight 1 MB layers (fp32 Adam), 0.1 MB stashed per sample, 10 MB per device: only ZeRO-3 on one
    # stage of four ranks fits (9.8 MB; tests/test_zero_planning.py lists the alternatives).
    names = [f"l{i}" for i in range(8)]
    db = chain(8, param_bytes=dict.fromkeys(names, 1e6), stash_bytes=dict.fromkeys(names, 1e5), micro_batches=(4,),
               hw=hardware(memory_bytes=1e7, optimizer_factor=3.0, link=CommFit(alpha_s=0.0, beta_s_per_byte=1e-9)))
    costs, path = tmp_path / "costs.json", tmp_path / "plan.json"
    db.save(costs)
    argv = ["plan", costs, "--devices", 4, "--mini-batch", 16, "--micro-batches", "4", "--quiet"]
    assert gpp(*argv) == 2 and "found no plan" in capsys.readouterr().err
    assert gpp(*argv, "--zero", "auto", "-o", path) == 0
    out = capsys.readouterr().out
    assert Plan.load(path).zero_stage == 3
    assert '"zero_optimization": {"stage": 3}' in out and "ZeRO stage 3" in out
    assert gpp("simulate", path, "--costs", costs) == 0
    assert "ZeRO stage 3" in capsys.readouterr().out
    assert gpp(*argv, "--zero", "5") == 2
    assert 'must be "auto" or a ZeRO stage 0, 1, 2, 3, got "5"' in capsys.readouterr().err


def test_gpp_plan_prints_zero_stage_0_by_default(costs, capsys):
    assert gpp("plan", costs, "--devices", DEVICES, "--mini-batch", MINI_BATCH, "--quiet") == 0
    assert '"zero_optimization": {"stage": 0}' in capsys.readouterr().out


@pytest.fixture
def chain_costs(tmp_path) -> Path:
    """Eight equal layers in a chain, a fast link and memory to spare: folding pays on two ranks."""
    from costdbs import chain

    names = [f"l{i}" for i in range(8)]
    db = chain(8, fwd=dict.fromkeys(names, 1e-3), bwd=dict.fromkeys(names, 2e-3), param_bytes=dict.fromkeys(names, 1e6),
               out_bytes=dict.fromkeys(names, 1e3), stash_bytes=dict.fromkeys(names, 1e4),
               hw=hardware(memory_bytes=1e9, link=CommFit(alpha_s=1e-6, beta_s_per_byte=1e-10)))
    path = tmp_path / "chain.json"
    db.save(path)
    return path


def test_gpp_plan_fold_prints_the_folding_and_the_graph_pipeline_config_that_runs_it(chain_costs, tmp_path, capsys):
    from gpp_deepspeed.planner.simulate import simulate_folded

    path = tmp_path / "plan.json"
    assert gpp("plan", chain_costs, "--devices", "2", "--mini-batch", "8", "--micro-batches", "1", "--fold", "2",
               "--schedules", "1f1b,zb1,zb2", "-o", path, "--quiet") == 0
    out = capsys.readouterr().out
    plan = Plan.load(path)
    # Two ranks, four stages in ZB-V's V under its own order: the folded plan beats every unfolded
    # schedule here.
    assert plan.fold == (0, 1, 1, 0) and plan.schedule == "zbv" and plan.num_devices == 2
    assert "folded: 2 ranks, up to 2 stages each: rank 0 [0, 3], rank 1 [1, 2]" in out
    assert '"graph_pipeline": {"schedule": "zbv", "stages_per_rank": 2, "fold": [0, 1, 1, 0]}' in out
    assert simulate_folded(plan, CostDB.load(chain_costs)).prediction == plan.predicted
    assert gpp("simulate", path, "--costs", chain_costs, "--json") == 0   # per stage, folded
    sim = json.loads(capsys.readouterr().out)
    assert sim["iteration_time_s"] == plan.predicted.iteration_time_s and len(sim["stages"]) == 4


def test_gpp_compare_fold_shows_the_folded_and_unfolded_plans_side_by_side(chain_costs, capsys):
    assert gpp("compare", chain_costs, "--devices", "2", "--mini-batch", "8", "--micro-batches", "1", "--fold", "2",
               "--methods", "graphpipe", "--schedules", "1f1b,zb1", "--json", "--quiet") == 0
    side = json.loads(capsys.readouterr().out)["folded_vs_unfolded"]
    assert [r["plan"] for r in side] == ["unfolded", "folded"]
    unfolded, folded = side
    assert folded["step_s"] < unfolded["step_s"] and folded["bubble_fraction"] < unfolded["bubble_fraction"]
    assert len(unfolded["rank_mem_bytes"]) == len(folded["rank_mem_bytes"]) == 2 and folded["fold"] == [0, 1, 1, 0]
    assert gpp("compare", chain_costs, "--devices", "2", "--mini-batch", "8", "--micro-batches", "1", "--fold", "2",
               "--methods", "graphpipe", "--quiet") == 0
    text = capsys.readouterr().out
    assert "GraphPipe folded and unfolded, side by side" in text and re.search(r"^folded\s.*\bzbv\b", text, re.M)


def test_gpp_fold_refuses_other_planners_by_name(chain_costs, capsys):
    assert gpp("plan", chain_costs, "--devices", "2", "--mini-batch", "8", "--fold", "2", "--method", "ds-uniform",
               "--quiet") == 2
    assert "--fold folds GraphPipe's plans" in capsys.readouterr().err
