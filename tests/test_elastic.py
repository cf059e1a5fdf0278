"""Lose a node, keep training (issue 31): torch elastic restarts on the ranks that are left, with a
new plan, from the last checkpoint, with no person and no edited file.

Three local ``torchrun`` agents of 2 ranks each stand in for three nodes (gloo, ``--nnodes=2:3``,
the c10d rendezvous). ``tests/workers/elastic_worker.py`` trains a DAG model (``four_branch``),
planned by ``partition_method="graphpipe"`` for the ranks present, saves a checkpoint at step 4 and
goes on; the test then kills one agent with its ranks (``SIGKILL``: the node is gone). The
survivors' ranks stop (the watchdog or a closed connection), their agents re-rendezvous as a world
of 4, and the worker plans for 4 ranks, loads the checkpoint into that layout and trains to the
end of the epoch. Checked: the losses from the resume equal those of a launch by hand of 4 ranks
from that checkpoint (rtol 1e-5), and every sample of the epoch was seen exactly once across the
two worlds (the first world's steps after the checkpoint are lost, as they would be). The
rendezvous store is served by the test, so that any agent can die (the agent serving it takes
the rendezvous with it, as on a cluster).
"""

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from dist import free_port, launch

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
WORKER = Path(__file__).resolve().parent / "workers" / "elastic_worker.py"
STEPS, SAVE_AT, NUM_SAMPLES, BATCH = 12, 4, 96, 8   # as in workers/elastic_worker.py


def records(out, name):
    path = Path(out, name)
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def agent_cmd(port, out, extra, nproc):
    return [str(BIN / "torchrun"), "--nnodes=2:3", f"--nproc-per-node={nproc}", "--max-restarts=3",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=gpp-{uuid.uuid4().hex[:8]}",
            "--rdzv-conf=is_host=false,last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=3",
            "--monitor-interval=0.5", str(WORKER), str(out), "--steps", str(STEPS), "--save-at", str(SAVE_AT), *extra]


def run_elastic(out, extra, *, kill_output_stage, nproc=2, timeout=300, env=None):
    """Three agents of ``nproc`` ranks; kill one once the checkpoint is saved; returns (agents'
    return codes, logs, the kill's wall time)."""
    port = free_port()
    store = torch.distributed.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                                       timeout=timedelta(seconds=60))
    tag = uuid.uuid4().hex
    env = dict(os.environ, OMP_NUM_THREADS="1", PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]), GPP_TEST_JOB=tag,
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", **(env or {}))   # see docs/faults.md
    cmd = agent_cmd(port, out, extra, nproc)
    logs = [open(Path(out, f"agent{k}.log"), "w+") for k in range(3)]
    agents = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
              for log in logs]
    start, killed_at = time.monotonic(), None
    try:
        while killed_at is None and time.monotonic() - start < timeout:
            first = [w for w in records(out, "who.jsonl") if w["world"] == 3 * nproc]
            if Path(out, "saved").exists() and len(first) == 3 * nproc:
                holds_output = {w["agent"] for w in first if w["output"]}
                victim = next(a for a in agents if (a.pid in holds_output) == kill_output_stage)
                for pid in [victim.pid] + [w["pid"] for w in first if w["agent"] == victim.pid]:
                    os.kill(pid, signal.SIGKILL)   # the node is gone: its agent and its ranks
                killed_at = time.time()
            elif any(a.poll() is not None for a in agents):
                break
            time.sleep(0.2)
        while any(a.poll() is None for a in agents) and time.monotonic() - start < timeout:
            time.sleep(0.5)
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
            a.wait()
        del store
    text = []
    for log in logs:
        log.seek(0)
        text.append(log.read())
        log.close()
    return [a.returncode for a in agents], text, killed_at


def rate(losses):
    """Samples per second over consecutive steps' records (wall times of their ends)."""
    return f"{(len(losses) - 1) * BATCH / (losses[-1]['t'] - losses[0]['t']):.0f}" if len(losses) > 1 else "-"


def check_samples_seen_once(out):
    seen = records(out, "seen.jsonl")
    first = [i for s in seen if s["world"] == 6 and s["step"] < SAVE_AT for i in s["idx"]]
    second = [i for s in seen if s["world"] == 4 for i in s["idx"]]
    assert len(first) == SAVE_AT * BATCH and len(second) == (STEPS - SAVE_AT) * BATCH, (len(first), len(second))
    assert sorted(first + second) == list(range(NUM_SAMPLES)), "every sample of the epoch exactly once"


@pytest.mark.parametrize("training_data,kill_output_stage", [(False, False), (True, True)],
                         ids=["data_iter", "training_data-scheduler-output_stage_lost"])
def test_a_lost_agent_restarts_on_the_ranks_left_with_a_new_plan_from_the_checkpoint(tmp_path, training_data,
                                                                                     kill_output_stage):
    out = tmp_path / "elastic"
    out.mkdir()
    extra = ["--training-data", "--scheduler"] if training_data else []
    rcs, logs, killed_at = run_elastic(out, extra, kill_output_stage=kill_output_stage)
    report = "\n".join(f"--- agent {k} (rc {rc}) ---\n{t[-3000:]}" for k, (rc, t) in enumerate(zip(rcs, logs)))
    assert killed_at is not None, report
    assert sorted(rcs) == [-signal.SIGKILL, 0, 0], report   # the two agents left finish the job
    second = [w for w in records(out, "who.jsonl") if w["world"] == 4]
    assert len(second) == 4 and any(w["output"] for w in second), report
    resumed = [r for r in records(out, "losses.jsonl") if r["world"] == 4]
    assert [r["step"] for r in resumed] == list(range(SAVE_AT + 1, STEPS + 1)), resumed
    first = [r for r in records(out, "losses.jsonl") if r["world"] == 6]
    print(f"elastic restart ({'training_data' if training_data else 'data_iter'}): first step on 4 ranks "
          f"{resumed[0]['t'] - killed_at:.1f} s after the agent was killed; steps lost "
          f"{max(r['step'] for r in first) - SAVE_AT}; samples/s on 6 ranks {rate(first[:SAVE_AT])}, on 4 {rate(resumed)}")
    check_samples_seen_once(out)

    # The same checkpoint, by hand, on 4 ranks: the same losses.
    by_hand = tmp_path / "by_hand"
    by_hand.mkdir()
    result = launch(4, WORKER, str(by_hand), "--steps", str(STEPS), "--save-at", str(SAVE_AT), "--load",
                    str(out / "ckpt"), *extra, timeout=240, log_dir=tmp_path / "logs")
    assert result.ok, result.report()
    expected = records(by_hand, "losses.jsonl")
    assert [r["step"] for r in expected] == [r["step"] for r in resumed]
    torch.testing.assert_close([r["loss"] for r in resumed], [r["loss"] for r in expected], rtol=1e-5, atol=0)
    if training_data:
        lrs = {r["step"]: r["lr"] for r in records(out, "lr.jsonl") if r["world"] == 4}
        assert lrs == {r["step"]: r["lr"] for r in records(by_hand, "lr.jsonl")}
        fresh = {r["step"]: r["lr"] for r in records(out, "lr.jsonl") if r["world"] == 6}
        assert lrs[SAVE_AT + 1] > fresh[SAVE_AT] > fresh[1], "the warm-up resumed where it was"
