"""partition_method="graphpipe" timing the layers on the ranks' own devices at start-up (gloo, CPU)."""

import json

import pytest

from dist import ROOT, launch
from gpp_deepspeed.planner import CostDB
from gpp_deepspeed.planner.search import graphpipe_partition

pytestmark = pytest.mark.dist
WORKER = ROOT / "tests" / "workers" / "device_profile.py"


def _run(tmp_path, *modes: str) -> list[list[dict]]:
    """Each mode's output of every rank, the modes run one after the other in one launch."""
    res = launch(2, WORKER, str(tmp_path), *modes, timeout=300, log_dir=tmp_path / "logs")
    assert res.ok, res.report()
    return [[json.loads((tmp_path / f"{mode}.rank{r}").read_text()) for r in range(2)] for mode in modes]


def test_graphpipe_plans_from_layers_timed_at_start_up_and_every_rank_agrees(tmp_path):
    profiled, proxy = _run(tmp_path, "profiled", "proxy")
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


def test_the_start_up_links_are_timed_between_every_pair_inside_and_across_nodes(tmp_path):
    # 4 ranks, LOCAL_SIZE=2: two "nodes". Pairs (0, 1) and (2, 3) time the link inside a node, all
    # at once; (0, 2) and (1, 3) the link across. Every rank assembles the same database.
    worker = ROOT / "tests" / "workers" / "device_links.py"
    res = launch(4, worker, str(tmp_path / "links"), timeout=300, log_dir=tmp_path / "logs", env={"LOCAL_SIZE": "2"})
    assert res.ok, res.report()
    dbs = [CostDB.from_json((tmp_path / f"links.rank{r}").read_text()) for r in range(4)]
    assert all(db == dbs[0] for db in dbs)
    hw = dbs[0].hardware
    assert "between 2 pairs inside a node, 2 across nodes" in hw.name and hw.devices_per_node == 2
    assert hw.intra.alpha_s + hw.intra.beta_s_per_byte > 0 and hw.inter.alpha_s + hw.inter.beta_s_per_byte > 0
    assert [c.param_bytes for c in dbs[0].layers] == [(16 + 4) * 4] * 2
