"""Where a compute action's CPU time goes: each layer of the call stack under our forward and
backward, against torch.distributed.pipelining's ``forward_one_chunk`` / ``backward_one_chunk``.

Issue 28, point 5 asks for a cost per action at most torch's and DeepSpeed's. ``overhead.py`` and
``peers.py`` measure a step; this says which code a forward's and a backward's CPU time is spent in.
Two gloo ranks train a 2-stage chain of four 8x8 linear layers (no compute to speak of: an action is
the runtime's own work), first on our engine (1F1B, 16 micro-batches), then on torch's action-list
runtime (``ScheduleInterleaved1F1B``, one stage per rank) over the same layers. Each function below
is wrapped to record the main thread's CPU time (``time.thread_time``) of every call, nested: a
line's time includes the lines under it, so the difference between two lines is the code between
them. The three runtimes take one step each per round, in turn; medians over the calls of 20
rounds after 3, per rank (rank 1 holds the loss).

    python benchmarks/compute_stack.py            # writes benchmarks/results/compute_stack.{json,md}
    python benchmarks/compute_stack.py --ab DIR   # the before/after table of DIR/{before,after}_<i>.json
                                                  # (compute_stack.json of alternating launches of two commits)
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
M, MBS, DIM, STEPS, WARM_UP = 16, 2, 8, 20, 3

# The stack, outermost first: (label, what it adds). A runtime without the layer has no entry.
ROWS = [("FORWARD: the handler", "ours: `GraphPipelineEngine._exec_forward_pass` (the stage's inputs gathered); "
         "DeepSpeed's: `PipelineEngine._exec_forward_pass`; torch's: `forward_one_chunk`"),
        ("PipelineEngine._exec_forward_pass", "DeepSpeed's: its inputs cloned, its timers, the loss on the last stage"),
        ("DeepSpeedEngine.forward", "DeepSpeed's forward hooks (prologue, epilogue), backward hooks on the outputs"),
        ("the stage module's forward", "the layers, through `GraphPipelineModule`'s interpreter (ours) or "
         "`PipelineModule.forward` (DeepSpeed's)"),
        ("BACKWARD: the handler", "ours: `StageBackward.full`; DeepSpeed's: `PipelineEngine._exec_backward_pass`; "
         "torch's: `backward_one_chunk`"),
        ("PipelineEngine._exec_backward_pass", "the last stage's `DeepSpeedEngine.backward(loss)` (its loss scaling, "
         "hooks, timers)"),
        ("torch.autograd.backward", "autograd itself, from the received gradients or the loss")]
RUNTIMES = ("ours", "deepspeed", "torch")
# Every call that posts, completes or waits for a message, summed over a step: ours, the transfer
# actions and their waits; DeepSpeed's, its four send / receive instructions (each blocking);
# torch's, its stage's P2P ops built and its batches posted and waited for.
TRANSFERS = "transfers"


def _timed(fn, calls: dict, phase: list, label: str):
    """``fn``, recording each call's main-thread CPU time in ``calls[phase[0]][label]``."""
    def timed(*args, **kwargs):
        start = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            calls[phase[0]][label].append(time.thread_time() - start)
    return timed


def _rounds(steps: dict, calls: dict, phase: list) -> None:
    """One step of each runtime per round, in turn (a shared machine's load falls on all alike),
    each recorded under its own name; the first ``WARM_UP`` rounds are left out."""
    for i in range(WARM_UP + STEPS):
        if i == WARM_UP:
            for by_label in calls.values():
                for c in by_label.values():
                    c.clear()
        for runtime, step in steps.items():
            phase[0] = runtime
            step()


def worker(out: str) -> None:
    import torch
    from torch import nn
    import deepspeed
    import gpp_deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.pipe.engine import PipelineEngine
    from deepspeed.runtime.pipe import schedule as ds
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B
    from torch.distributed.pipelining import schedules as torch_schedules
    from gpp_deepspeed.engine.instructions import Transfers, WaitReceives, WaitSends

    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    calls = {runtime: {label: [] for label in [*(label for label, _ in ROWS), TRANSFERS]} for runtime in RUNTIMES}
    phase = ["ours"]
    timed = lambda fn, label: _timed(fn, calls, phase, label)  # noqa: E731
    torch.manual_seed(0)
    data = [(torch.randn(MBS, DIM), torch.randn(MBS, DIM)) for _ in range(M)]
    cfg = {"train_micro_batch_size_per_gpu": MBS, "gradient_accumulation_steps": M, "steps_per_print": 10**6,
           "optimizer": {"type": "SGD", "params": {"lr": 1e-3}}}
    # DeepSpeed's handlers, as its engine dispatches them (its instruction map) and as ours calls them
    # (the class attributes).
    for instruction, name, row in ((ds.ForwardPass, "_exec_forward_pass", ROWS[1][0]),
                                   (ds.BackwardPass, "_exec_backward_pass", ROWS[5][0])):
        handler = timed(getattr(PipelineEngine, name), row)
        setattr(PipelineEngine, name, handler)
        PipelineEngine._INSTRUCTION_MAP[instruction] = handler
    for instruction in (ds.SendActivation, ds.RecvActivation, ds.SendGrad, ds.RecvGrad):
        PipelineEngine._INSTRUCTION_MAP[instruction] = timed(PipelineEngine._INSTRUCTION_MAP[instruction], TRANSFERS)
    DeepSpeedEngine.forward = timed(DeepSpeedEngine.forward, ROWS[2][0])
    torch.autograd.backward = timed(torch.autograd.backward, ROWS[6][0])   # every runtime's backward calls it

    module = gpp_deepspeed.GraphPipelineModule([LayerSpec(nn.Linear, DIM, DIM) for _ in range(4)], num_stages=2,
                                               loss_fn=nn.MSELoss(), partition_method="uniform")
    engine, *_ = gpp_deepspeed.initialize(model=module, model_parameters=module.parameters(), config={
        **cfg, "graph_pipeline": {"print_stage_graph": False, "print_memory": False, "print_idle_fractions": False}})
    table = engine._INSTRUCTION_MAP
    table[ds.ForwardPass] = timed(table[ds.ForwardPass], ROWS[0][0])
    module.forward = timed(module.forward, ROWS[3][0])
    engine.stage_backward.full = timed(engine.stage_backward.full, ROWS[4][0])
    for instruction in (Transfers, WaitReceives, WaitSends):
        table[instruction] = timed(table[instruction], TRANSFERS)

    # DeepSpeed's own engine on the same layers: its handlers are the rows above
    torch.manual_seed(0)
    ds_module = PipelineModule([LayerSpec(nn.Linear, DIM, DIM) for _ in range(4)], num_stages=2, loss_fn=nn.MSELoss(),
                               partition_method="uniform")
    ds_engine, *_ = deepspeed.initialize(model=ds_module, model_parameters=ds_module.parameters(), config=cfg)
    ds_module.forward = timed(ds_module.forward, ROWS[3][0])

    # torch's action-list runtime: one stage of two of the layers per rank
    torch.manual_seed(0)
    stage_module = nn.Sequential(nn.Linear(DIM, DIM), nn.Linear(DIM, DIM))
    stage = PipelineStage(stage_module, rank, 2, torch.device("cpu"))
    optimizer = torch.optim.SGD(stage_module.parameters(), lr=1e-3)
    schedule = ScheduleInterleaved1F1B([stage], n_microbatches=M, loss_fn=nn.MSELoss())
    stage.forward_one_chunk = timed(stage.forward_one_chunk, ROWS[0][0])
    stage.backward_one_chunk = timed(stage.backward_one_chunk, ROWS[4][0])
    for name in ("get_fwd_recv_ops", "get_bwd_recv_ops", "get_fwd_send_ops", "get_bwd_send_ops"):
        setattr(stage, name, timed(getattr(stage, name), TRANSFERS))
    for name in ("_batch_p2p", "_wait_batch_p2p"):   # module globals, looked up at every call
        setattr(torch_schedules, name, timed(getattr(torch_schedules, name), TRANSFERS))
    x, y = torch.cat([d[0] for d in data]), torch.cat([d[1] for d in data])

    def torch_step():
        optimizer.zero_grad()
        schedule.step(x) if rank == 0 else schedule.step(target=y)
        optimizer.step()

    _rounds({"ours": lambda: engine.train_batch(iter(data)), "deepspeed": lambda: ds_engine.train_batch(iter(data)),
             "torch": torch_step}, calls, phase)
    calls["deepspeed"][ROWS[0][0]] = calls["deepspeed"][ROWS[1][0]]
    calls["deepspeed"][ROWS[4][0]] = calls["deepspeed"][ROWS[5][0]]
    medians = {runtime: {k: (len(v) / STEPS, statistics.median(v) if v else None) for k, v in by_label.items()}
               for runtime, by_label in calls.items()}
    for runtime, by_label in calls.items():   # transfers: calls and CPU seconds a step
        medians[runtime][TRANSFERS] = (len(by_label[TRANSFERS]) / STEPS, sum(by_label[TRANSFERS]) / STEPS)
    every = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, medians)
    if rank == 0:
        Path(out).write_text(json.dumps(every))
    torch.distributed.destroy_process_group()


def main() -> None:
    if "--worker" in sys.argv:
        return worker(sys.argv[sys.argv.index("--out") + 1])
    if "--ab" in sys.argv:
        return print(ab_table(Path(sys.argv[sys.argv.index("--ab") + 1])))
    sys.path.insert(0, str(ROOT / "tests"))
    from dist import launch

    with tempfile.TemporaryDirectory(prefix="gpp_compute_stack_") as tmp:
        out = Path(tmp) / "stack.json"
        res = launch(2, Path(__file__), "--worker", "--out", str(out), timeout=600, log_dir=Path(tmp) / "logs")
        if not res.ok:
            raise SystemExit(res.report())
        ranks = json.loads(out.read_text())
    (ROOT / "benchmarks" / "results" / "compute_stack.json").write_text(json.dumps(ranks, indent=1))
    write_section(ranks)
    print((ROOT / "benchmarks" / "results" / "compute_stack.md").read_text())


def write_section(ranks: list[dict]) -> None:
    """``benchmarks/results/compute_stack.md``, the section of docs/benchmarks.md (report.py)."""
    def us(runtime, r, label):
        med = ranks[r][runtime][label][1]
        return None if med is None else 1e6 * med

    def cell(runtime, r, label):
        value = us(runtime, r, label)
        return "" if value is None else f"{value:.0f}"

    lines = ["## Where a compute action's CPU time goes (compute_stack.py)", "",
             "`python benchmarks/compute_stack.py` (issue 28, point 5). Two gloo ranks, a 2-stage chain of four 8x8 "
             f"linear layers, {M} micro-batches, 1F1B: our engine, then DeepSpeed's `PipelineEngine`, then torch's "
             "action-list runtime (`ScheduleInterleaved1F1B`, one stage per rank), each on the same layers. Each "
             "call below is wrapped to record the main thread's CPU time of every call; a row includes the rows "
             f"under it, so the difference of two rows is the code between them. One step of each runtime per round, "
             f"in turn; medians over the calls of {STEPS} rounds after {WARM_UP}, in us; rank 1 holds the loss.", "",
             "| call | what it adds | ours, rank 0 | ours, rank 1 | DeepSpeed's, rank 0 | DeepSpeed's, rank 1 "
             "| torch's, rank 0 | torch's, rank 1 |", "|---|---|---|---|---|---|---|---|"]
    for label, what in ROWS:
        lines.append(f"| {label} | {what} | " + " | ".join(cell(rt, r, label) for rt in RUNTIMES for r in (0, 1))
                     + " |")
    lines += ["", "Transfers: the CPU time a step of every call that posts, completes or waits for a message, in ms "
              "(calls a step): ours, the transfer actions and their waits; DeepSpeed's, its send and receive "
              "instructions (each blocks until its message is done); torch's, the stage's P2P ops built and its "
              "batches posted and waited for.", "",
              "| transfers a step | ours, rank 0 | ours, rank 1 | DeepSpeed's, rank 0 | DeepSpeed's, rank 1 "
              "| torch's, rank 0 | torch's, rank 1 |", "|---|---|---|---|---|---|---|",
              "| CPU, ms (calls) | " + " | ".join(
                  f"{1e3 * ranks[r][rt][TRANSFERS][1]:.2f} ({ranks[r][rt][TRANSFERS][0]:.0f})"
                  for rt in RUNTIMES for r in (0, 1)) + " |"]
    f, b = ROWS[0][0], ROWS[4][0]
    for r in (0, 1):
        lines += ["", f"Rank {r}: a forward costs {us('ours', r, f):.0f} us of CPU on ours, "
                  f"{us('deepspeed', r, f):.0f} on DeepSpeed's engine and {us('torch', r, f):.0f} on torch's; a "
                  f"backward {us('ours', r, b):.0f}, {us('deepspeed', r, b):.0f} and {us('torch', r, b):.0f}. Inside "
                  f"ours, DeepSpeed's `DeepSpeedEngine.forward` adds {us('ours', r, ROWS[2][0]) - us('ours', r, ROWS[3][0]):.0f} "
                  "us around the stage's layers and its `PipelineEngine._exec_forward_pass` "
                  f"{us('ours', r, ROWS[1][0]) - us('ours', r, ROWS[2][0]):.0f} around that; our handler "
                  f"{us('ours', r, f) - us('ours', r, ROWS[1][0]):.0f}."]
    (ROOT / "benchmarks" / "results" / "compute_stack.md").write_text("\n".join(lines) + "\n")


def ab_table(folder: Path) -> str:
    """Before against after: for each of ``folder``'s ``{before,after}_<i>.json`` launches, our
    forward's and backward's CPU time and their ratio to DeepSpeed's engine in the same launch;
    medians over the launches, and the range of the ratio."""
    lines = ["| code | rank | launches | forward: ours (us) | DeepSpeed's | ours / DeepSpeed's (range) "
             "| stage module's forward: ours | DeepSpeed's | backward: ours | DeepSpeed's | ours / DeepSpeed's (range) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for code in ("before", "after"):
        runs = [json.loads(f.read_text()) for f in sorted(folder.glob(f"{code}_*.json"))]
        for r in (0, 1):
            def med(runtime, row):
                return 1e6 * statistics.median(run[r][runtime][row][1] for run in runs)

            def ratio(row):
                each = [run[r]["ours"][row][1] / run[r]["deepspeed"][row][1] for run in runs]
                return f"{statistics.median(each):.3f} ({min(each):.3f}-{max(each):.3f})"

            f, m, b = ROWS[0][0], ROWS[3][0], ROWS[4][0]
            lines.append(f"| {code} | {r} | {len(runs)} | {med('ours', f):.0f} | {med('deepspeed', f):.0f} | {ratio(f)} "
                         f"| {med('ours', m):.0f} | {med('deepspeed', m):.0f} | {med('ours', b):.0f} | "
                         f"{med('deepspeed', b):.0f} | {ratio(b)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
