"""partition_method="graphpipe" timing the layers on the ranks' own devices at start-up (gloo, CPU)."""

import json

import pytest

from dist import ROOT, launch
from gpp_deepspeed.planner import CostDB
from gpp_deepspeed.planner.search import graphpipe_partition

pytestmark = pytest.mark.dist
WORKER = ROOT / "tests" / "workers" / "device_profile.py"


def _run(tmp_path, mode: str) -> list[dict]:
    out = tmp_path / mode
    res = launch(2, WORKER, str(out), mode, timeout=300, log_dir=tmp_path / f"logs_{mode}")
    assert res.ok, res.report()
    return [json.loads((tmp_path / f"{mode}.rank{r}").read_text()) for r in range(2)]


def test_graphpipe_plans_from_layers_timed_at_start_up_and_every_rank_agrees(tmp_path):
    profiled, proxy = _run(tmp_path, "profiled"), _run(tmp_path, "proxy")
    # every rank planned from the same numbers, so every rank has the same partition
    assert profiled[0] == profiled[1] and proxy[0]["stage_of"] == proxy[1]["stage_of"]
    db = CostDB.from_json(profiled[0]["costs"])
    # the sleeping layer was timed where it ran (each rank timed its share, the ranks exchanged them)
    slow = db.by_name["slow"]
    assert slow.fwd_s[0] >= 0.02 and all(t < 0.02 for c in db.layers if c.name != "slow" for t in c.fwd_s)
    assert slow.bwd_input_s is not None and "timed at start-up by 2 ranks" in db.source
    # the partition is GraphPipe's search on those numbers, at the largest micro-batch timed
    assert profiled[0]["stage_of"] == graphpipe_partition(db, num_stages=2, micro_batch=2)
    # timed, the slow layer gets a stage of its own; priced by parameters, it shares one
    stage_of = profiled[0]["stage_of"]
    assert [n for n, s in stage_of.items() if s == stage_of["slow"]] == ["slow"]
    assert len([n for n, s in proxy[0]["stage_of"].items() if s == proxy[0]["stage_of"]["slow"]]) > 1
