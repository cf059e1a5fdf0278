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

With ``--sleeping MS`` every layer sleeps ``MS`` ms in its forward and again in its backward
(``sleeping.py``, as in ``peers.py``) and each call records its wall time (``time.perf_counter``)
instead: what a call costs in a pipeline whose compute takes time, where the runtime's code runs
after every sleep with its caches gone cold (a call's wall time there is several times its CPU time
in the loop without compute). A row minus the row under it is then that layer's wall time; the
transfers table gives only the calls that post messages (a wait's wall time is the peer's).

    python benchmarks/compute_stack.py            # writes benchmarks/results/compute_stack.{json,md}
    python benchmarks/compute_stack.py --sleeping 10   # compute_stack_sleeping.{json,md} (20 ms a stage, as peers.py)
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

import report

ROOT = Path(__file__).resolve().parent.parent
M, MBS, DIM, STEPS, WARM_UP = 16, 2, 8, 20, 3

# The stack, outermost first: (label, what it adds). A runtime without the layer has no entry.
ROWS = [("FORWARD: the handler", "ours: `GraphPipelineEngine._exec_forward_pass` (the stage's inputs gathered); "
         "DeepSpeed's: `PipelineEngine._exec_forward_pass`; torch's: `forward_one_chunk`"),
        ("PipelineEngine._exec_forward_pass", "DeepSpeed's: its inputs cloned, its timers, the loss on the last stage"),
        ("DeepSpeedEngine.forward", "DeepSpeed's forward hooks (prologue, epilogue), backward hooks on the outputs"),
        ("the stage module's forward", "the layers, through `GraphPipelineModule`'s interpreter (ours) or "
         "`PipelineModule.forward` (DeepSpeed's), or the stage's `nn.Sequential` (torch's)"),
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
# The calls among those that post messages (ours: the transfer actions; torch's: its P2P ops built and
# its batches posted): in wall time, without the waits, whose wall time is the peer's.
POSTING = "posting"


def sleeping_linear(ms: float):
    """``nn.Linear`` whose forward and backward each sleep ``ms`` ms (``sleeping.sleep_grad``)."""
    from torch import nn
    from sleeping import sleep_grad

    SleepGrad = sleep_grad()

    class SleepingLinear(nn.Linear):
        def forward(self, x):
            time.sleep(ms / 1e3)
            return SleepGrad.apply(super().forward(x), ms / 1e3)

    return SleepingLinear


def _timed(fn, calls: dict, phase: list, label: str, clock=time.thread_time):
    """``fn``, recording each call's main-thread CPU time (or ``clock``'s) in ``calls[phase[0]][label]``."""
    def timed(*args, **kwargs):
        start = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            calls[phase[0]][label].append(clock() - start)
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


def worker(out: str, sleep_ms: float = 0.0) -> None:
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
    calls = {runtime: {label: [] for label in [*(label for label, _ in ROWS), TRANSFERS, POSTING]}
             for runtime in RUNTIMES}
    phase = ["ours"]
    clock = time.perf_counter if sleep_ms else time.thread_time
    timed = lambda fn, label: _timed(fn, calls, phase, label, clock)  # noqa: E731
    Linear = sleeping_linear(sleep_ms) if sleep_ms else nn.Linear
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

    module = gpp_deepspeed.GraphPipelineModule([LayerSpec(Linear, DIM, DIM) for _ in range(4)], num_stages=2,
                                               loss_fn=nn.MSELoss(), partition_method="uniform")
    engine, *_ = gpp_deepspeed.initialize(model=module, model_parameters=module.parameters(), config={
        **cfg, "graph_pipeline": {"print_stage_graph": False, "print_memory": False, "print_idle_fractions": False}})
    table = engine._INSTRUCTION_MAP
    table[ds.ForwardPass] = timed(table[ds.ForwardPass], ROWS[0][0])
    module.forward = timed(module.forward, ROWS[3][0])
    engine.stage_backward.full = timed(engine.stage_backward.full, ROWS[4][0])
    for instruction in (Transfers, WaitReceives, WaitSends):
        table[instruction] = timed(table[instruction], TRANSFERS)
    table[Transfers] = timed(table[Transfers], POSTING)

    # DeepSpeed's own engine on the same layers: its handlers are the rows above
    torch.manual_seed(0)
    ds_module = PipelineModule([LayerSpec(Linear, DIM, DIM) for _ in range(4)], num_stages=2, loss_fn=nn.MSELoss(),
                               partition_method="uniform")
    ds_engine, *_ = deepspeed.initialize(model=ds_module, model_parameters=ds_module.parameters(), config=cfg)
    ds_module.forward = timed(ds_module.forward, ROWS[3][0])

    # torch's action-list runtime: one stage of two of the layers per rank
    torch.manual_seed(0)
    stage_module = nn.Sequential(Linear(DIM, DIM), Linear(DIM, DIM))
    stage = PipelineStage(stage_module, rank, 2, torch.device("cpu"))
    optimizer = torch.optim.SGD(stage_module.parameters(), lr=1e-3)
    schedule = ScheduleInterleaved1F1B([stage], n_microbatches=M, loss_fn=nn.MSELoss())
    stage.forward_one_chunk = timed(stage.forward_one_chunk, ROWS[0][0])
    stage_module.forward = timed(stage_module.forward, ROWS[3][0])
    stage.backward_one_chunk = timed(stage.backward_one_chunk, ROWS[4][0])
    for name in ("get_fwd_recv_ops", "get_bwd_recv_ops", "get_fwd_send_ops", "get_bwd_send_ops"):
        setattr(stage, name, timed(timed(getattr(stage, name), TRANSFERS), POSTING))
    for name in ("_batch_p2p", "_wait_batch_p2p"):   # module globals, looked up at every call
        fn = timed(getattr(torch_schedules, name), TRANSFERS)
        setattr(torch_schedules, name, timed(fn, POSTING) if name == "_batch_p2p" else fn)
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
    for runtime, by_label in calls.items():   # transfers: calls and seconds a step
        for label in (TRANSFERS, POSTING):
            medians[runtime][label] = (len(by_label[label]) / STEPS, sum(by_label[label]) / STEPS)
    every = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, medians)
    if rank == 0:
        Path(out).write_text(json.dumps(every))
    torch.distributed.destroy_process_group()


def main() -> None:
    sleep_ms = float(sys.argv[sys.argv.index("--sleeping") + 1]) if "--sleeping" in sys.argv else 0.0
    if "--worker" in sys.argv:
        return worker(sys.argv[sys.argv.index("--out") + 1], sleep_ms)
    if "--ab" in sys.argv:
        return print(ab_table(Path(sys.argv[sys.argv.index("--ab") + 1])))
    sys.path.insert(0, str(ROOT / "tests"))
    from dist import launch

    with tempfile.TemporaryDirectory(prefix="gpp_compute_stack_") as tmp:
        out = Path(tmp) / "stack.json"
        res = launch(2, Path(__file__), "--worker", "--out", str(out), *(["--sleeping", str(sleep_ms)] if sleep_ms else []),
                     timeout=600 + 6 * sleep_ms * M * (WARM_UP + STEPS) / 1e3, log_dir=Path(tmp) / "logs")
        if not res.ok:
            raise SystemExit(res.report())
        ranks = json.loads(out.read_text())
    name = "compute_stack_sleeping" if sleep_ms else "compute_stack"
    (ROOT / "benchmarks" / "results" / f"{name}.json").write_text(json.dumps({"sleep_ms": sleep_ms, "ranks": ranks}
                                                                             if sleep_ms else ranks, indent=1))
    write_section(ranks, sleep_ms)
    print((ROOT / "benchmarks" / "results" / f"{name}.md").read_text())


def write_section(ranks: list[dict], sleep_ms: float = 0.0) -> None:
    """``benchmarks/results/compute_stack.md`` (``compute_stack_sleeping.md`` with sleeping layers),
    a section of docs/benchmarks.md (report.py)."""
    def us(runtime, r, label):
        med = ranks[r][runtime][label][1]
        return None if med is None else 1e6 * med

    def cell(runtime, r, label):
        value = us(runtime, r, label)
        return "" if value is None else f"{value:.0f}"

    what = "wall time" if sleep_ms else "CPU time"
    layers = (f"four 8x8 linear layers, each sleeping {sleep_ms:g} ms in its forward and again in its backward "
              "(`--sleeping`)" if sleep_ms else "four 8x8 linear layers")
    lines = [f"## Where a compute action's {what} goes (compute_stack.py{' --sleeping' if sleep_ms else ''})", "",
             f"`python benchmarks/compute_stack.py{f' --sleeping {sleep_ms:g}' if sleep_ms else ''}` (issue 28, point "
             f"5). Two gloo ranks, a 2-stage chain of {layers}, {M} micro-batches, 1F1B: our engine, then DeepSpeed's "
             "`PipelineEngine`, then torch's action-list runtime (`ScheduleInterleaved1F1B`, one stage per rank), "
             f"each on the same layers. Each call below is wrapped to record the main thread's {what} of every call; "
             "a row includes the rows under it, so the difference of two rows is the code between them. One step of "
             f"each runtime per round, in turn; medians over the calls of {STEPS} rounds after {WARM_UP}, in us; rank "
             "1 holds the loss." + (" With sleeping layers every row holds the stage's sleeps; what each runtime "
                                    "adds is a row minus the stage module's forward (or, for a backward, "
                                    "`torch.autograd.backward`)." if sleep_ms else ""), "",
             "| call | what it adds | ours, rank 0 | ours, rank 1 | DeepSpeed's, rank 0 | DeepSpeed's, rank 1 "
             "| torch's, rank 0 | torch's, rank 1 |", "|---|---|---|---|---|---|---|---|"]
    for label, text in ROWS:
        lines.append(f"| {label} | {text} | " + " | ".join(cell(rt, r, label) for rt in RUNTIMES for r in (0, 1))
                     + " |")
    # Messages: with sleeping layers only the calls that post them (a wait's wall time is the peer's),
    # so not DeepSpeed's, whose instructions block until their message is done.
    key, shown, intro = (POSTING, ("ours", "torch"), "Posting messages: the wall time a step of the calls that post "
                         "them, in ms (calls a step): ours, the transfer actions (a receive they complete in place "
                         "waits there); torch's, the stage's P2P ops built and its batches posted. DeepSpeed's send "
                         "and receive instructions block until their message is done, so their wall time is the "
                         "peer's too: not shown.") if sleep_ms else (
        TRANSFERS, RUNTIMES, "Transfers: the CPU time a step of every call that posts, completes or waits for a "
        "message, in ms (calls a step): ours, the transfer actions and their waits; DeepSpeed's, its send and "
        "receive instructions (each blocks until its message is done); torch's, the stage's P2P ops built and its "
        "batches posted and waited for.")
    names = {"ours": "ours", "deepspeed": "DeepSpeed's", "torch": "torch's"}
    lines += ["", intro, "", f"| {key} a step | " + " | ".join(f"{names[rt]}, rank {r}" for rt in shown for r in (0, 1))
              + " |", "|---|" + "---|" * (2 * len(shown)),
              f"| {'wall' if sleep_ms else 'CPU'}, ms (calls) | " + " | ".join(
                  f"{1e3 * ranks[r][rt][key][1]:.2f} ({ranks[r][rt][key][0]:.0f})" for rt in shown for r in (0, 1))
              + " |"]
    f, m, b, g = ROWS[0][0], ROWS[3][0], ROWS[4][0], ROWS[6][0]
    for r in (0, 1):
        if sleep_ms:   # what each runtime adds around the same layers and the same autograd pass
            adds = {rt: (us(rt, r, f) - us(rt, r, m), us(rt, r, b) - us(rt, r, g)) for rt in RUNTIMES}
            costs = (f"around the stage's layers a forward adds {adds['ours'][0]:.0f} us of wall time on ours, "
                     f"{adds['deepspeed'][0]:.0f} on DeepSpeed's engine and {adds['torch'][0]:.0f} on torch's; around "
                     f"autograd's pass a backward adds {adds['ours'][1]:.0f}, {adds['deepspeed'][1]:.0f} and "
                     f"{adds['torch'][1]:.0f}")
        else:
            costs = (f"a forward costs {us('ours', r, f):.0f} us of CPU on ours, {us('deepspeed', r, f):.0f} on "
                     f"DeepSpeed's engine and {us('torch', r, f):.0f} on torch's; a backward {us('ours', r, b):.0f}, "
                     f"{us('deepspeed', r, b):.0f} and {us('torch', r, b):.0f}")
        lines += ["", f"Rank {r}: {costs}. Inside ours, DeepSpeed's `DeepSpeedEngine.forward` adds "
                  f"{us('ours', r, ROWS[2][0]) - us('ours', r, m):.0f} us around the stage's layers and its "
                  f"`PipelineEngine._exec_forward_pass` {us('ours', r, ROWS[1][0]) - us('ours', r, ROWS[2][0]):.0f} "
                  f"around that; our handler {us('ours', r, f) - us('ours', r, ROWS[1][0]):.0f}."]
    name = "compute_stack_sleeping" if sleep_ms else "compute_stack"
    if report.notes(name):
        lines += ["", report.notes(name).rstrip("\n")]
    (ROOT / "benchmarks" / "results" / f"{name}.md").write_text("\n".join(lines) + "\n")


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
