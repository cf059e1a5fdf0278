"""``gpp_deepspeed.viz`` and ``gpp viz``: every picture is written, names every stage, and the
numbers on it (edge bytes, trace times) are the cost model's and the timeline's."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from costdbs import branches
from gpp_deepspeed import viz
from gpp_deepspeed.cli import main
from gpp_deepspeed.planner import Plan, PlanStage, graphpipe_search, simulate_plan

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
OUT_BYTES = {"b0_0": 100, "b0_1": 1536, "b1_0": 100, "b1_1": 2 * 2**20, "b2_0": 100, "b2_1": 3 * 2**10}


@pytest.fixture(scope="module")
def db():
    return branches(3, 2, out_bytes=OUT_BYTES)


@pytest.fixture(scope="module")
def plan(db) -> Plan:
    plan = graphpipe_search(db, num_devices=3, mini_batch=8).plan
    assert plan.num_stages > 1   # else the pictures below test little
    return plan


@pytest.fixture(scope="module")
def timeline(plan, db):
    return simulate_plan(plan, db).timeline


def hand_plan() -> Plan:
    """One branch per stage; the last stage also holds the join ``cat``."""
    return Plan(model="synthetic", method="manual", source="hand", micro_batch=2, mini_batch=8,
                stages=(PlanStage(layers=("b0_0", "b0_1")), PlanStage(layers=("b1_0", "b1_1")),
                        PlanStage(layers=("b2_0", "b2_1", "cat"))))


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 1000, path


def assert_svg_names_stages(path: Path, num_stages: int) -> None:
    text = path.read_text()
    assert text.lstrip().startswith("<?xml") and "<svg" in text
    for s in range(num_stages):
        assert f"stage {s}" in text, (path, s)


@pytest.mark.parametrize("draw", ["layer_dag", "stage_dag", "gantt"])
def test_viz_draw_writes_a_png_and_an_svg_naming_every_stage(draw, db, plan, timeline, tmp_path):
    calls = {"layer_dag": lambda p: viz.draw_layer_dag(db, plan.stage_of, p),
             "stage_dag": lambda p: viz.draw_stage_dag(plan, db, p),
             "gantt": lambda p: viz.draw_gantt(timeline, p)}
    assert calls[draw](tmp_path / f"{draw}.png") == tmp_path / f"{draw}.png"
    assert_png(tmp_path / f"{draw}.png")
    calls[draw](tmp_path / f"{draw}.svg")
    assert_svg_names_stages(tmp_path / f"{draw}.svg", plan.num_stages)


def test_viz_layer_dag_accepts_a_layer_graph_and_drops_names_of_large_graphs(tmp_path):
    big = branches(4, 25)   # 101 layers: above the label limit
    stage_of = {c.name: i % 3 for i, c in enumerate(big.layers)}
    viz.draw_layer_dag(big.graph, stage_of, tmp_path / "big.svg")
    text = (tmp_path / "big.svg").read_text()
    assert "layer names omitted" in text and "b0_7" not in text
    assert_svg_names_stages(tmp_path / "big.svg", 3)


def test_viz_stage_edge_bytes_are_the_outputs_the_destination_reads(db, tmp_path):
    plan = hand_plan()
    assert viz.stage_edge_bytes(plan, db) == {(0, 2): 1536.0, (1, 2): 2.0 * 2**20}
    viz.draw_stage_dag(plan, db, tmp_path / "stages.svg")
    text = (tmp_path / "stages.svg").read_text()
    assert "1.5 KiB/sample" in text and "2 MiB/sample" in text
    assert "x1" in text and "b0_0 .. b0_1" in text and "3 layers" in text


def test_viz_stage_edge_bytes_of_a_chain_plan_relay_every_crossing_tensor(db):
    chain = dataclasses.replace(hand_plan(), pipeline="chain")
    # The cut after stage 1 carries b0_1 (relayed) and b1_1.
    assert viz.stage_edge_bytes(chain, db) == {(0, 1): 1536.0, (1, 2): 1536.0 + 2 * 2**20}


def test_viz_format_bytes_uses_binary_units():
    assert [viz.format_bytes(b) for b in (0, 1023, 1024, 1536, 5 * 2**30)] == \
        ["0 B", "1023 B", "1 KiB", "1.5 KiB", "5 GiB"]


def test_viz_chrome_trace_has_one_x_event_per_span_in_microseconds(timeline, tmp_path):
    viz.write_chrome_trace(timeline, tmp_path / "trace.json")
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    spans = sorted((s, str(a), start * 1e6, (end - start) * 1e6)
                   for s, items in timeline.spans.items() for a, start, end in items)
    xs = sorted((e["tid"], e["name"], e["ts"], e["dur"]) for e in events if e["ph"] == "X")
    assert xs == spans
    assert all(e["pid"] == 0 for e in events)


def test_gpp_viz_writes_every_picture_and_the_trace(db, plan, tmp_path, capsys):
    db.save(tmp_path / "costs.json")
    plan.save(tmp_path / "plan.json")
    out = tmp_path / "pictures"
    assert main(["viz", str(tmp_path / "plan.json"), "--costs", str(tmp_path / "costs.json"), "-o", str(out),
                 "--format", "both"]) == 0
    names = {f"{n}.{s}" for n in ("layer_dag", "stage_dag", "gantt") for s in ("png", "svg")} | {"trace.json"}
    assert {p.name for p in out.iterdir()} == names
    printed = capsys.readouterr().out
    for name in names:
        assert str(out / name) in printed
    assert_png(out / "gantt.png")


def test_gpp_viz_with_a_missing_plan_exits_2(db, tmp_path, capsys):
    db.save(tmp_path / "costs.json")
    assert main(["viz", str(tmp_path / "nope.json"), "--costs", str(tmp_path / "costs.json"),
                 "-o", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gpp: error:") and "nope.json" in err and "Traceback" not in err


def test_importing_viz_does_not_load_matplotlib():
    code = "import sys, gpp_deepspeed.viz; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
