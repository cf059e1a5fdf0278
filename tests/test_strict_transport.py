"""The engine under a transport at least as strict as NCCL's (``tests/strict_p2p.py``).

NCCL cannot run two ranks here, so these tests run the engine on gloo with every point-to-point
op made strict: a send completes only when its receive has been launched, a batch completes as a
whole, a rank launches its groups one at a time in posting order, batched and single ops never
match, and a hang ends the launch within seconds (exit code 3, the stuck group printed).

* The controls show the strict transport stops where NCCL would and plain gloo does not: a
  cross-send (each rank sends in a batch before receiving in the next), and a batched send against
  a single receive. Both finish under plain gloo and are reported as hangs under strict.
* The matrix trains, in one launch of four ranks, every schedule (1f1b, gpipe, zb1, zb2 and the
  asynchronous pipedream, 2bw and pipeoptim) on stage graphs with fan-out, fan-in and skip edges,
  a sequential chain whose skip is relayed, per-stage degrees, and ``dynamic_shape`` models under
  1f1b and zb2, and checks each against its single-process reference (the references of
  ``test_equivalence``, ``test_stage_degrees`` and ``test_async_training``), with every rank
  having posted only batched ops.
"""

import pytest
import torch

from dist import launch
from reference import train_reference
from strict_p2p import HANG_EXIT_CODE
from test_async_training import _case as async_case, _check_against_reference
from test_equivalence import case as eq_case
from test_stage_degrees import SKIP3, case as degrees_case

pytestmark = pytest.mark.dist

WORKERS = __import__("pathlib").Path(__file__).resolve().parent / "workers"
STRICT = {"GPP_STRICT_P2P": "1", "GPP_STRICT_P2P_HANG_S": "30"}
SHORT = {"steps": 2}   # the first batch sends layouts, the second does not (static shapes)

SYNC = [eq_case("four_branch", 4, 0, **SHORT),                        # fan-out into a fan-in, 1f1b
        eq_case("diamond", 4, 1, schedule="gpipe", **SHORT),
        eq_case("fanout3", 4, 0, schedule="zb1", **SHORT),
        eq_case("skip", 4, 1, schedule="zb2", **SHORT),                # skip edges
        eq_case("four_branch", 4, 0, schedule="zb1", early_receives=False, **SHORT),   # receives in place
        eq_case("skip", 4, 0, partition="golden/plan_skip_chain_s4.json", **SHORT),  # a chain: l1 relayed
        eq_case("varlen", 4, 1, **SHORT),                              # dynamic_shape, 1f1b
        eq_case("varlen", 4, 0, schedule="zb2", **SHORT)]              # dynamic_shape, zb2
DEGREES = [degrees_case("four_branch", [2, 1, 1], 0, **SHORT),
           degrees_case("skip", [1, 2, 1], 1, partition=SKIP3, tag="-zb1", schedule="zb1", **SHORT)]
ASYNC = [async_case("skip", "pipedream", degrees=(2, 1, 1), **SHORT),
         async_case("tied", "2bw", stages=4, clip=0.05, **SHORT),
         async_case("chain", "pipeoptim", stages=4, **SHORT)]
CASES = [{**c, "id": "strict-" + c["id"]} for c in SYNC + DEGREES + ASYNC]


def _control(scenario, tmp_path, *, strict):
    env = {"GPP_STRICT_P2P": "1" if strict else "0", "GPP_STRICT_P2P_HANG_S": "3"}
    return launch(2, WORKERS / "strict_control.py", scenario, timeout=60, log_dir=tmp_path / scenario, env=env)


def test_strict_transport_runs_a_send_and_its_receive_posted_in_one_batch(tmp_path):
    result = _control("grouped", tmp_path, strict=True)
    assert result.ok, result.report()
    assert "received [1.0, 1.0, 1.0, 1.0]" in result.outputs[0] and "'single_ops': 0" in result.outputs[0]


def test_the_engines_transport_posts_one_by_one_on_gloo_and_every_batch_through_a_replaced_batch_isend_irecv(
        tmp_path):
    # On gloo, torch's batch_isend_irecv is a loop of isend / irecv, which the transport runs itself;
    # the strict transport (a replacement) must still see each transfer action as one batch.
    plain = _control("transport", tmp_path / "plain", strict=False)
    assert plain.ok and "one by one=True" in plain.outputs[0], plain.report()
    assert "received [1.0, 1.0, 1.0, 1.0] strict=None" in plain.outputs[0], plain.report()
    strict = _control("transport", tmp_path / "strict", strict=True)
    assert strict.ok and "one by one=False" in strict.outputs[0], strict.report()
    assert "received [1.0, 1.0, 1.0, 1.0]" in strict.outputs[0], strict.report()
    assert "'batched_ops': 2, 'single_ops': 0" in strict.outputs[0], strict.report()


@pytest.mark.parametrize("scenario,stuck", [("cross_send", "[send 4 float32 to 1]"),
                                            ("mixed", "[send 4 float32 to 1]")])
def test_strict_transport_reports_a_hang_where_nccl_hangs_and_plain_gloo_does_not(tmp_path, scenario, stuck):
    plain = _control(scenario, tmp_path / "plain", strict=False)
    assert plain.ok and "received [1.0, 1.0, 1.0, 1.0]" in plain.outputs[0], plain.report()
    strict = _control(scenario, tmp_path / "strict", strict=True)
    assert not strict.timed_out and HANG_EXIT_CODE in strict.returncodes, strict.report()
    assert f"strict p2p: rank 0 hangs on group 1 (batched) {stuck} after 3 s" in strict.outputs[0], strict.report()
    assert strict.seconds < 30, "reported within the hang timeout, not at the launch's"


@pytest.fixture(scope="module")
def strict_out(run_cases):
    return run_cases("strict_w4", 4, CASES, timeout=900, env=STRICT)


def _ranks(out, c):
    ranks = [torch.load(out / f"{c['id']}.rank{r}.pt") for r in range(4)]
    for r, res in enumerate(ranks):
        stats = res["strict_p2p"]
        assert stats is not None and stats["groups"] > 0, f"rank {r} ran without the strict transport"
        assert stats["single_ops"] == 0, f"rank {r} posted single point-to-point ops: {stats}"
    return ranks


@pytest.mark.parametrize("c", CASES[:len(SYNC) + len(DEGREES)], ids=[c["id"] for c in CASES[:len(SYNC) + len(DEGREES)]])
def test_synchronous_schedules_under_the_strict_transport_equal_the_single_device_model(strict_out, c):
    ranks = _ranks(strict_out, c)
    ref = train_reference(c, dp=4 // (sum(c["degrees"]) if "degrees" in c else c["stages"]))
    for r, res in enumerate(ranks):
        assert res["schedule"] == c.get("schedule", "1f1b")
        assert res["losses"] == pytest.approx(ref.losses, rel=1e-5), f"rank {r} (stage {res['stage']})"
        assert res["eval"] == pytest.approx(ref.eval_loss, rel=1e-5), f"rank {r} (stage {res['stage']})"
        for name, value in res["state"].items():
            torch.testing.assert_close(value, ref.state[name], rtol=1e-5, atol=1e-6, msg=f"rank {r}: {name}")


@pytest.mark.parametrize("c", CASES[-len(ASYNC):], ids=[c["id"] for c in CASES[-len(ASYNC):]])
def test_asynchronous_schedules_under_the_strict_transport_follow_their_update_rule(strict_out, c):
    _check_against_reference(c, _ranks(strict_out, c))


def test_a_layout_too_large_for_its_fixed_header_names_the_edge_its_size_and_the_fix():
    from gpp_deepspeed.engine.p2p import decode_header, encode_header, header_capacity
    from gpp_deepspeed.errors import GPPError

    fits = [torch.zeros(2, 3, 5, 7)] * 10   # 1 + 10 x (2 + 4) = 61 ints, and the count: 62 of 66
    header = encode_header([10], fits, capacity=header_capacity(1), edge=(2, 5))
    assert len(header) == header_capacity(1) == 66
    assert decode_header(header).specs == (((2, 3, 5, 7), torch.float32), ) * 10
    with pytest.raises(GPPError, match=r"the layout of edge 2 -> 5 \(1 port\(s\), 20 tensors of up to 4 dims\) "
                                       r"takes 123 int64s, more than its fixed header of 66 \(64 per port\); send "
                                       "fewer tensors on that edge"):
        encode_header([20], fits * 2, capacity=header_capacity(1), edge=(2, 5))
