"""ZeRO inside a stage: each rank's parameters, gradients and optimizer state, measured against the formula.

    python benchmarks/zero_memory.py        # writes benchmarks/results/zero_memory.{json,md}

A two-stage graph pipeline whose stage 0 (eight ``Linear(512, 512)``, 2.1 M parameters) runs on
``n`` = 1, 2 and 4 ranks (``stage_degrees=[n, 1]``, ``n + 1`` gloo ranks) and whose stage 1 is a
small head, trained 2 steps of 4 micro-batches (1F1B) with torch's Adam in fp32 under ZeRO-0, 1, 2
and 3. After every action of the schedule each rank of stage 0 adds up the distinct tensor storages
it holds:

* parameters: the stage module's parameters (under ZeRO-3 this rank's partitions, ``ds_tensor``,
  and whatever is gathered at that moment);
* gradients: the parameters' ``.grad`` and the optimizer's gradient buffers (ZeRO-1's flat
  partition gradient at the step; ZeRO-2's reduce bucket, its accumulated partition and the
  partition it hands the step; ZeRO-3's flat gradient partition:
  ``gpp_deepspeed.engine.compat.optimizer_gradient_tensors``);
* optimizer state: Adam's moments and ZeRO's fp32 master partition (torch's Adam under ZeRO-0 keeps
  no master copy).

The table gives each one's peak over the run, and the peak of their sum, per rank of stage 0,
beside the formula for a stage of ``P`` parameters on ``n`` ranks (fp32, 4 bytes, Adam's two moments;
Rajbhandari et al., "ZeRO", SC 2020, Sec. 5, with fp32 in place of mixed precision):

=======  ==========  ====================  ==============
ZeRO     parameters  gradients             optimizer
=======  ==========  ====================  ==============
0        4P          4P                    8P
1        4P          4P + 4B               12P/n
2        4P          4P/n                  12P/n
3        4P/n        4P/n + 4B             8P/n
=======  ==========  ====================  ==============

``B`` is the reduce bucket (elements). ZeRO-1 keeps whole gradients until ``REDUCE_GRAD`` and its
bucket, filled by its hooks, until then too; ZeRO-2 frees its bucket at the end of each backward,
ZeRO-3 keeps it. ZeRO-3 on fp32 parameters steps its fp32 partition of the parameters itself (no
separate master copy: Adam's moments alone).

What the samples miss: storages alive only inside an action (ZeRO-2's bucket during a backward, and
each parameter's gradient whole between autograd writing it and the hook copying it into the bucket;
the flat partition's gradient, 4P/n, inside ZeRO-1's and ZeRO-2's step; ZeRO-3's gathered layer
during its forward or backward), and anything outside these three (activations, communication
buffers, the runtime).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
RESULTS = ROOT / "benchmarks" / "results"
MIB = 2**20

HIDDEN, LAYERS, CLASSES = 512, 8, 10
DEGREES, ZERO_STAGES = (1, 2, 4), (0, 1, 2, 3)
BUCKET = 2**18      # ZeRO-2's reduce bucket, in elements (DeepSpeed's default, 5e8, is 2 GB of fp32)
MBS, GAS, STEPS = 4, 4, 2
# ZeRO-3 frees a layer's parameters after use: no prefetch, no reuse window, no small parameters kept
# whole (its defaults keep up to 1e9 elements gathered when reused soon, and biases whole).
ZERO3_RELEASE = {"stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0, "stage3_param_persistence_threshold": 0}


def _specs():
    from torch import nn
    from gpp_deepspeed import GraphLayerSpec
    specs = [GraphLayerSpec(f"l{i}", nn.Linear, HIDDEN, HIDDEN, inputs=["x" if i == 0 else f"l{i - 1}"])
             for i in range(LAYERS)]
    return specs + [GraphLayerSpec("head", nn.Linear, HIDDEN, CLASSES, inputs=[f"l{LAYERS - 1}"])]


def _storage_bytes(tensors, skip=frozenset()) -> tuple[int, set]:
    seen, total = set(skip), 0
    for t in tensors:
        if t is None or t.numel() == 0:
            continue
        key = t.untyped_storage().data_ptr()
        if key and key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total, seen - set(skip)


def _sample(engine) -> tuple[int, int, int]:
    from gpp_deepspeed.engine import compat
    from gpp_deepspeed.engine.memory import _optimizer_tensors
    params = list(engine.module.parameters())
    p_bytes, p_keys = _storage_bytes([*params, *compat.zero3_stage_partitions(params)])
    g_bytes, g_keys = _storage_bytes([*(p.grad for p in params), *compat.optimizer_gradient_tensors(engine.optimizer)],
                                     p_keys)
    o_bytes, _ = _storage_bytes(_optimizer_tensors(engine.optimizer), p_keys | g_keys)
    return p_bytes, g_bytes, o_bytes


def _watch(engine, peaks: dict) -> None:
    """Sample after every action: the instance's dispatch table wraps the class's handlers."""
    def wrap(handler):
        def run(self, *args, **kwargs):
            out = handler(self, *args, **kwargs)
            p, g, o = _sample(self)
            if handler.__name__ == "_exec_optimizer_step":   # what the rank holds between batches
                peaks["params_at_rest"] = p
            for key, value in (("params", p), ("grads", g), ("optimizer", o), ("sum", p + g + o)):
                peaks[key] = max(peaks.get(key, 0), value)
            return out
        return run
    engine._INSTRUCTION_MAP = {kind: wrap(handler) for kind, handler in type(engine)._INSTRUCTION_MAP.items()}


def worker(out: str) -> None:
    import torch
    from torch import nn
    import deepspeed
    import gpp_deepspeed
    from gpp_deepspeed import GraphPipelineModule

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    degree = world - 1
    results = []
    for zero in ZERO_STAGES:
        torch.manual_seed(0)
        module = GraphPipelineModule(_specs(), input_names=["x"], loss_fn=nn.CrossEntropyLoss(), num_stages=2,
                                     partition_method={**{f"l{i}": 0 for i in range(LAYERS)}, "head": 1},
                                     stage_degrees=[degree, 1])
        config = {"train_micro_batch_size_per_gpu": MBS, "gradient_accumulation_steps": GAS,
                  "train_batch_size": MBS * GAS, "steps_per_print": 10**6, "gradient_clipping": 1.0,
                  "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
                  "zero_optimization": {"stage": zero, "reduce_bucket_size": BUCKET, "allgather_bucket_size": BUCKET,
                                        **(ZERO3_RELEASE if zero == 3 else {})},
                  "graph_pipeline": {"print_stage_graph": False}}
        engine, *_ = gpp_deepspeed.initialize(model=module, model_parameters=[p for p in module.parameters()],
                                              config=config)
        peaks: dict = {}
        _watch(engine, peaks)
        g = torch.Generator().manual_seed(1)
        for _ in range(STEPS):
            batches = [(torch.randn(MBS, HIDDEN, generator=g), torch.randint(0, CLASSES, (MBS, ), generator=g))
                       for _ in range(GAS)]
            engine.train_batch(iter(batches))
        stage_params = sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters())
        results.append({"zero": zero, "degree": degree, "rank": rank, "stage": engine.stage_id,
                        "stage_params": stage_params, "optimizer": type(engine.optimizer).__name__, **peaks})
        torch.distributed.barrier()
    Path(f"{out}.rank{rank}").write_text(json.dumps(results))
    torch.distributed.destroy_process_group()


def formula(zero: int, params: int, degree: int) -> dict:
    """Bytes per rank (see the module docstring)."""
    p, n = 4 * params, degree
    grads = {0: p, 1: p + 4 * BUCKET, 2: p / n, 3: p / n + 4 * BUCKET}[zero]
    optimizer = {0: 8 * params, 1: 12 * params / n, 2: 12 * params / n, 3: 8 * params / n}[zero]
    return {"params": p / n if zero == 3 else p, "grads": grads, "optimizer": optimizer}


def measure() -> list[dict]:
    from dist import launch
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for degree in DEGREES:
            prefix = Path(tmp) / f"zero_d{degree}"
            result = launch(degree + 1, Path(__file__), "--worker", str(prefix), timeout=900,
                            log_dir=Path(tmp) / f"logs_d{degree}")
            if not result.ok:
                raise RuntimeError(result.report())
            for r in range(degree + 1):
                rows += [row for row in json.loads(Path(f"{prefix}.rank{r}").read_text()) if row["stage"] == 0]
    return rows


def write(rows: list[dict]) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "zero_memory.json").write_text(json.dumps(rows, indent=1))
    lines = ["## ZeRO inside a stage: parameters, gradients and optimizer state per rank (measured)", "",
             f"Stage 0 of a two-stage pipeline ({LAYERS} x `Linear({HIDDEN}, {HIDDEN})`, "
             f"{rows[0]['stage_params'] / 1e6:.2f} M parameters) on n ranks (`stage_degrees=[n, 1]`), torch's Adam "
             f"in fp32, {STEPS} steps of {GAS} micro-batches (1F1B), reduce bucket {BUCKET} elements, ZeRO-3 "
             "set to free every layer after use (`ZERO3_RELEASE`). Peak MiB "
             "per rank of stage 0 (the largest over its ranks), sampled after every action of the schedule; "
             "in brackets the formula (`benchmarks/zero_memory.py` gives it and what the samples miss). "
             "The last column is what each rank holds after the optimizer step, between batches.", "",
             "| ZeRO | n | parameters | gradients | optimizer state | peak of the sum | optimizer + gradients vs n = 1 "
             "| parameters after the step |", "|---|---|---|---|---|---|---|---|"]
    best = {}
    for zero in ZERO_STAGES:
        for degree in DEGREES:
            mine = [r for r in rows if r["zero"] == zero and r["degree"] == degree]
            best[zero, degree] = {k: max(r[k] for r in mine)
                                  for k in ("params", "grads", "optimizer", "sum", "params_at_rest")}
    params = rows[0]["stage_params"]
    for zero in ZERO_STAGES:
        for degree in DEGREES:
            m, f = best[zero, degree], formula(zero, params, degree)
            base = best[zero, 1]["grads"] + best[zero, 1]["optimizer"]
            ratio = (m["grads"] + m["optimizer"]) / base
            cells = [f"{m[k] / MIB:.1f} ({f[k] / MIB:.1f})" for k in ("params", "grads", "optimizer")]
            lines.append(f"| {zero} | {degree} | " + " | ".join(cells)
                         + f" | {m['sum'] / MIB:.1f} | {ratio:.2f} | {m['params_at_rest'] / MIB:.1f} |")
    (RESULTS / "zero_memory.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    write(measure())
    print((RESULTS / "zero_memory.md").read_text())
    import report
    report.main()


if __name__ == "__main__":
    main()
