"""Unit tests of the "graph_pipeline" config section: pure, CPU-only."""

from __future__ import annotations

import pytest

from gpp_deepspeed.config import CONFIG_KEY, GraphPipelineConfig, parse_graph_pipeline_config, with_plan_schedule
from gpp_deepspeed.errors import GPPConfigError


@pytest.mark.parametrize("ds_config", [None, {}, {"train_micro_batch_size_per_gpu": 4}, {"graph_pipeline": {}}])
def test_parse_graph_pipeline_config_uses_defaults_when_the_section_is_absent_or_empty(ds_config):
    cfg = parse_graph_pipeline_config(ds_config)
    assert cfg == GraphPipelineConfig()
    assert (cfg.schedule, cfg.validate_schedule, cfg.print_stage_graph) == ("1f1b", True, True)


def test_parse_graph_pipeline_config_reads_every_valid_setting():
    cfg = parse_graph_pipeline_config({
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 8,
        "graph_pipeline": {"schedule": "gpipe", "validate_schedule": False, "print_stage_graph": False},
    })
    assert (cfg.schedule, cfg.validate_schedule, cfg.print_stage_graph) == ("gpipe", False, False)
    assert CONFIG_KEY == "graph_pipeline"


def test_parse_graph_pipeline_config_result_is_frozen():
    cfg = parse_graph_pipeline_config({})
    with pytest.raises(Exception):
        cfg.schedule = "gpipe"


def test_parse_graph_pipeline_config_rejects_an_unknown_key_by_name():
    with pytest.raises(GPPConfigError) as info:
        parse_graph_pipeline_config({"graph_pipeline": {"scheduel": "1f1b"}})
    msg = str(info.value)
    assert "scheduel" in msg and "graph_pipeline" in msg
    assert "schedule" in msg.replace("scheduel", "")  # lists the valid keys
    assert isinstance(info.value, ValueError)


def test_parse_graph_pipeline_config_names_every_unknown_key():
    with pytest.raises(GPPConfigError) as info:
        parse_graph_pipeline_config({"graph_pipeline": {"micro_batches": 4, "stages": 2}})
    msg = str(info.value)
    assert "graph_pipeline.micro_batches" in msg and "graph_pipeline.stages" in msg


@pytest.mark.parametrize("section, field", [
    ({"schedule": "chimera"}, "schedule"),
    ({"schedule": 1}, "schedule"),
    ({"validate_schedule": "maybe"}, "validate_schedule"),
    ({"print_stage_graph": [True]}, "print_stage_graph"),
    ({"gc_interval": -1}, "gc_interval"),
    ({"activation_meter_steps": 0}, "activation_meter_steps"),
    ({"activation_meter_steps": "first"}, "activation_meter_steps"),
])
def test_parse_graph_pipeline_config_rejects_a_wrong_value_naming_the_field(section, field):
    with pytest.raises(GPPConfigError) as info:
        parse_graph_pipeline_config({"graph_pipeline": section})
    assert f"graph_pipeline.{field}" in str(info.value)


@pytest.mark.parametrize("section", ["1f1b", ["schedule"], 3])
def test_parse_graph_pipeline_config_rejects_a_section_that_is_not_an_object(section):
    with pytest.raises(GPPConfigError, match="graph_pipeline"):
        parse_graph_pipeline_config({"graph_pipeline": section})


@pytest.mark.parametrize("name", ["zb1", "zb2"])
def test_parse_graph_pipeline_config_accepts_the_zero_bubble_schedules(name):
    assert parse_graph_pipeline_config({"graph_pipeline": {"schedule": name}}).schedule == name


def test_a_plans_schedule_applies_unless_the_config_names_one():
    assert with_plan_schedule(parse_graph_pipeline_config({}), "zb1").schedule == "zb1"
    assert with_plan_schedule(parse_graph_pipeline_config({}), None).schedule == "1f1b"
    named = parse_graph_pipeline_config({"graph_pipeline": {"schedule": "1f1b", "print_stage_graph": False}})
    kept = with_plan_schedule(named, "zb2")
    assert (kept.schedule, kept.print_stage_graph) == ("1f1b", False)
    other = with_plan_schedule(parse_graph_pipeline_config({"graph_pipeline": {"print_stage_graph": False}}), "zb2")
    assert (other.schedule, other.print_stage_graph) == ("zb2", False)
    with pytest.raises(ValueError, match="schedule"):
        with_plan_schedule(GraphPipelineConfig(), "zb9")  # a plan file naming no known schedule


def test_load_config_reads_a_deepspeed_config_as_initialize_does_and_refuses_a_repeated_key(tmp_path):
    # what the examples read their optimizer and batch values with (no DeepSpeed private name)
    import base64
    import json

    from gpp_deepspeed.config import load_config

    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
              CONFIG_KEY: {"schedule": "zb1"}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    assert load_config(str(path)) == config == load_config(config)
    assert load_config(base64.urlsafe_b64encode(json.dumps(config).encode()).decode()) == config
    path.write_text('{"gradient_clipping": 1.0, "gradient_clipping": 0.0}')
    with pytest.raises(ValueError, match="gradient_clipping"):
        load_config(str(path))


def test_load_config_before_initialize_leaves_gpp_deepspeed_initialize_the_function():
    # the examples call gpp_deepspeed.load_config first; a lazy name served from the module
    # gpp_deepspeed.initialize would have left the package attribute the module, not the function
    import subprocess
    import sys

    code = ("import gpp_deepspeed; gpp_deepspeed.load_config({}); "
            "assert callable(gpp_deepspeed.initialize), gpp_deepspeed.initialize")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_gc_interval_is_refused_while_pythons_automatic_collector_stays_on():
    from gpp_deepspeed.engine.collector import check_gc_config

    with pytest.raises(GPPConfigError, match='gc_interval = 5 .*"disable_python_gc": true'):
        check_gc_config({}, 5)
    check_gc_config({"disable_python_gc": True}, 5)   # DeepSpeed's switch: the interval says when
    check_gc_config({}, 0)
