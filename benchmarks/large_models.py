"""Large models on CPU ranks: memory per rank at initialize, the planner's memory model against measured
peaks, and a 1.5 B-parameter Llama loaded from, trained in and saved to Hugging Face directories.

    python benchmarks/large_models.py            # all three; writes benchmarks/results/large_models.{json,md}
    python benchmarks/large_models.py --only init,model,big

Run it with nothing else running on the machine: it measures resident memory.

* ``init``: a ``transformers`` ``LlamaForCausalLM`` of 98 M and 246 M parameters (hidden 1024, 4 and
  14 decoder layers, vocabulary 32000), 4 gloo ranks, 4 stages, ``partition_method="parameters"``,
  SGD; each rank's peak resident memory (``VmHWM``) at the end of ``gpp_deepspeed.initialize``
  above its resident memory after imports, for the model built on every rank and captured
  (``real``: the only way before deferred materialisation), built on the meta device and
  captured (``meta``), and the same shapes as a ``GraphLayerSpec`` list (``specs``);
  ``tests/workers/memory_worker.py`` measures.
* ``model``: a smaller Llama (hidden 512, 8 layers, vocabulary 8000, 256 tokens, micro-batch 4, 8
  micro-batches, Adam) trained 2 steps on 4 ranks; each rank's memory report after the last step
  (parameters, gradients, optimizer state, activation peak) beside the planner's prediction for
  the same stages (:func:`gpp_deepspeed.planner.simulate.predict` on a profile of the layers made
  by :func:`gpp_deepspeed.profiler.profile_layers`: GraphPipe's ``weights x (1 + optimizer factor) +
  in-flight x stash``).
* ``big``: a Llama of 1.47 B parameters (hidden 2048, intermediate 5632, 26 layers; 5.9 GB in fp32)
  written layer by layer as a sharded Hugging Face directory (never more than one layer in memory),
  loaded by 8 ranks (8 stages) that each read only their stage's tensors, trained 3 steps (plain
  SGD: Adam's two moments would add 11.7 GB to the 11.7 GB of parameters and gradients, more than
  this 24 GB machine holds beside eight runtimes), saved back as a sharded directory by every stage
  at once; per rank, peak memory against its stage's parameters, and the load and save times.
  Both directories live under ``/tmp`` and are deleted at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
RESULTS = ROOT / "benchmarks" / "results"
MIB = 2**20

INIT_SIZES = {"98 M": (1024, 2816, 4), "246 M": (1024, 2816, 14)}
BEFORE = "real"

MODEL = dict(vocab_size=8000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8)
MODEL_SEQ, MODEL_MBS, MODEL_GAS, MODEL_STEPS = 256, 4, 8, 2

BIG = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=26, num_attention_heads=16)
BIG_SEQ, BIG_MBS, BIG_GAS, BIG_STEPS, BIG_RANKS = 64, 1, 8, 3, 8


# -- shared ------------------------------------------------------------------------------------------

def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def _llama_names(layers: int) -> list[str]:
    return ["m.model.embed_tokens", *(f"m.model.layers.{i}" for i in range(layers)), "m.model.norm", "m.lm_head"]


def _lm(model):
    import torch

    class LM(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, input_ids):
            return self.m(input_ids=input_ids).logits

    return LM(model)


def _loss():
    import torch

    class NextTokenLoss(torch.nn.Module):
        def forward(self, logits, labels):
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())

    return NextTokenLoss()


def _batches(vocab: int, seq: int, mbs: int, gas: int, step: int):
    import torch
    g = torch.Generator().manual_seed(step)
    out = []
    for _ in range(gas):
        ids = torch.randint(0, vocab, (mbs, seq + 1), generator=g)
        out.append((ids[:, :-1], ids[:, 1:]))
    return out


def _launch(world: int, *args: str, timeout: float, log_dir: Path):
    from dist import launch
    result = launch(world, Path(__file__), *args, timeout=timeout, log_dir=log_dir)
    if not result.ok:
        raise SystemExit(result.report())
    return result


# -- init: peak memory at initialize -------------------------------------------------------------------

def run_init(tmp: Path) -> dict:
    from dist import launch
    worker = ROOT / "tests" / "workers" / "memory_worker.py"
    rows = {}
    for kind in (BEFORE, "meta", "specs"):
        for size, (hidden, intermediate, layers) in INIT_SIZES.items():
            prefix = tmp / f"{kind}_{layers}"
            result = launch(4, worker, kind, str(hidden), str(intermediate), str(layers), str(prefix), timeout=900,
                            log_dir=tmp / f"logs_{kind}_{layers}")
            if not result.ok:
                raise SystemExit(result.report())
            ranks = sorted((json.loads(Path(f"{prefix}.rank{r}").read_text()) for r in range(4)),
                           key=lambda d: d["stage"])
            rows[f"{kind}/{size}"] = ranks
            print(kind, size, [round((d["peak"] - d["imports"]) / MIB) for d in ranks], flush=True)
    return rows


def _init_table(rows: dict) -> str:
    lines = ["| model built | parameters | stage | stage parameters (MiB) | peak above imports (MiB) | ratio |",
             "|---|---|---|---|---|---|"]
    for key, ranks in rows.items():
        kind, size = key.split("/")
        for d in ranks:
            above = d["peak"] - d["imports"]
            lines.append(f"| {kind} | {size} | {d['stage']} | {d['stage_param_bytes'] / MIB:.0f} | {above / MIB:.0f} | "
                         f"{above / d['stage_param_bytes']:.2f}x |")
    lines += ["", "| model built | stage | slope (peak per parameter byte, 98 M to 246 M) | fixed cost (MiB) |",
              "|---|---|---|---|"]
    sizes = list(INIT_SIZES)
    for kind in (BEFORE, "meta", "specs"):
        for small, large in zip(rows[f"{kind}/{sizes[0]}"], rows[f"{kind}/{sizes[1]}"]):
            a_s, a_l = small["peak"] - small["imports"], large["peak"] - large["imports"]
            slope = (a_l - a_s) / (large["stage_param_bytes"] - small["stage_param_bytes"])
            lines.append(f"| {kind} | {small['stage']} | {slope:.2f} | {(a_s - slope * small['stage_param_bytes']) / MIB:.0f} |")
    return "\n".join(lines)


# -- model: the planner's memory model against measured --------------------------------------------------

def _model_captured(meta: bool = True):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from gpp_deepspeed.frontend import capture
    config = LlamaConfig(**MODEL, use_cache=False, max_position_embeddings=MODEL_SEQ)
    if meta:
        with torch.device("meta"):
            model = _lm(LlamaForCausalLM(config))
    else:
        model = _lm(LlamaForCausalLM(config))
    ids = torch.zeros(MODEL_MBS, MODEL_SEQ, dtype=torch.long)
    return capture(model, layers=_llama_names(MODEL["num_hidden_layers"]), example_inputs=(ids, ))


def model_worker(out: Path) -> None:
    import deepspeed
    import torch
    import gpp_deepspeed
    from gpp_deepspeed import GraphPipelineModule
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    captured = _model_captured()
    imports = _status("VmRSS")
    module = GraphPipelineModule(captured.layers, input_names=captured.input_names, output=captured.output,
                                 num_stages=4, loss_fn=_loss(), partition_method="parameters")
    params = [p for p in module.parameters() if p.requires_grad]
    config = {"train_micro_batch_size_per_gpu": MODEL_MBS, "gradient_accumulation_steps": MODEL_GAS,
              "train_batch_size": MODEL_MBS * MODEL_GAS, "steps_per_print": 10**6}
    engine, *_ = gpp_deepspeed.initialize(model=module, optimizer=torch.optim.Adam(params, lr=1e-4),
                                          model_parameters=params, config=config)
    for step in range(MODEL_STEPS):
        engine.train_batch(iter(_batches(MODEL["vocab_size"], MODEL_SEQ, MODEL_MBS, MODEL_GAS, step)))
    report = engine.memory_report()
    if rank == 0:
        (out / "model.json").write_text(json.dumps({
            "stage_of": dict(module.partition.stage_of), "imports": imports,
            "ranks": [dataclasses.asdict(m) for m in report.ranks]}))
    torch.distributed.barrier()


def run_model(tmp: Path) -> dict:
    import torch
    from gpp_deepspeed.planner import CommFit
    from gpp_deepspeed.planner.costs import Hardware
    from gpp_deepspeed.planner.plan import Plan, PlanStage
    from gpp_deepspeed.planner.simulate import predict
    from gpp_deepspeed.profiler import profile_layers
    _launch(4, "--worker", "model", str(tmp), timeout=1800, log_dir=tmp / "logs_model")
    measured = json.loads((tmp / "model.json").read_text())
    torch.manual_seed(0)
    captured = _model_captured(meta=True)
    link = CommFit(alpha_s=1e-5, beta_s_per_byte=1e-9)
    # Adam: one gradient and two moments per parameter byte (the Hardware docstring's fp32 Adam).
    hw = Hardware(name="cpu", memory_bytes=24 * 2**30, devices_per_node=4, intra=link, inter=link,
                  optimizer_factor=3.0)
    db = profile_layers(captured.layers, input_names=captured.input_names, output=captured.output,
                        make_inputs=lambda b: torch.randint(0, MODEL["vocab_size"], (b, MODEL_SEQ)),
                        micro_batches=(MODEL_MBS, ), warmup=0, repeats=1, model_name="llama-57M", hardware=hw)
    stage_of = measured["stage_of"]
    stages = tuple(PlanStage(layers=tuple(n for n in db.by_name if stage_of[n] == s)) for s in range(4))
    plan = predict(Plan(model="llama-57M", method="parameters", source=db.source, micro_batch=MODEL_MBS,
                        mini_batch=MODEL_MBS * MODEL_GAS, stages=stages), db)
    return {"measured": measured["ranks"], "predicted": list(plan.predicted.stage_mem_bytes),
            "in_flight": list(plan.predicted.stage_in_flight),
            "stash_per_sample": [sum(db.by_name[n].stash_bytes for n in s.layers) for s in stages],
            "param_bytes": [sum(db.by_name[n].param_bytes for n in s.layers) for s in stages]}


def _model_table(data: dict) -> str:
    lines = ["| stage | parameters | gradients | optimizer state | activation peak | measured sum | "
             "planner: weights x 4 | planner: in-flight x stash | planner sum | planner / measured |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for m in sorted(data["measured"], key=lambda m: m["stage_idx"]):
        s = m["stage_idx"]
        total = m["param_bytes"] + m["grad_bytes"] + m["optimizer_bytes"] + m["activation_peak_bytes"]
        weights = data["param_bytes"][s] * 4
        stash = data["predicted"][s] - weights
        lines.append(f"| {s} | {m['param_bytes'] / MIB:.1f} | {m['grad_bytes'] / MIB:.1f} | "
                     f"{m['optimizer_bytes'] / MIB:.1f} | {m['activation_peak_bytes'] / MIB:.1f} | {total / MIB:.1f} | "
                     f"{weights / MIB:.1f} | {data['in_flight'][s]} x {data['stash_per_sample'][s] * MODEL_MBS / MIB:.1f} "
                     f"= {stash / MIB:.1f} | {data['predicted'][s] / MIB:.1f} | {data['predicted'][s] / total:.2f} |")
    return "\n".join(lines)


# -- big: 1.5 B parameters in, trained, out -----------------------------------------------------------

def write_big_directory(directory: Path) -> dict:
    """A Hugging Face directory of a randomly initialised ``LlamaForCausalLM(BIG)``, written one
    layer at a time: the model is built on the meta device and each shard's submodule alone is
    materialised (the model's own ``_init_weights``), written and freed."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM
    from gpp_deepspeed.frontend.meta import ModuleInit, materialize, meta_copy
    start = time.perf_counter()
    config = LlamaConfig(**BIG, use_cache=False)
    config.architectures = ["LlamaForCausalLM"]
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    init = ModuleInit.of(model)
    units = ["model.embed_tokens", *(f"model.layers.{i}" for i in range(config.num_hidden_layers)), "model.norm",
             "lm_head"]
    directory.mkdir(parents=True)
    weight_map, total = {}, 0
    for k, unit in enumerate(units):
        torch.manual_seed(k)
        sub = materialize(meta_copy(model.get_submodule(unit)), init=init,
                          path_of=lambda n, u=unit: f"{u}.{n}" if n else u)
        tensors = {f"{unit}.{n}": t.detach() for n, t in sub.state_dict().items()}
        file = f"model-{k + 1:05d}-of-{len(units):05d}.safetensors"
        save_file(tensors, directory / file, metadata={"format": "pt"})
        weight_map.update({n: file for n in tensors})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del sub, tensors
    (directory / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    config.save_pretrained(directory)
    return {"bytes": total, "seconds": time.perf_counter() - start, "peak": _status("VmHWM")}


def big_worker(src: Path, dst: Path, out: Path) -> None:
    import deepspeed
    import torch
    from transformers import AutoConfig, LlamaForCausalLM
    import gpp_deepspeed
    from gpp_deepspeed import GraphPipelineModule, load_pretrained, save_pretrained
    from gpp_deepspeed.frontend import capture
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    imports = _status("VmRSS")
    start = time.perf_counter()
    config = AutoConfig.from_pretrained(src)
    config.use_cache = False
    with torch.device("meta"):
        model = _lm(LlamaForCausalLM(config))
    ids = torch.zeros(BIG_MBS, BIG_SEQ, dtype=torch.long)
    captured = load_pretrained(capture(model, layers=_llama_names(config.num_hidden_layers), example_inputs=(ids, )),
                               src)
    module = GraphPipelineModule(captured.layers, input_names=captured.input_names, output=captured.output,
                                 num_stages=BIG_RANKS, loss_fn=_loss(), partition_method="parameters")
    load_s = time.perf_counter() - start
    after_load = _status("VmHWM")
    params = [p for p in module.parameters() if p.requires_grad]
    ds_config = {"train_micro_batch_size_per_gpu": BIG_MBS, "gradient_accumulation_steps": BIG_GAS,
                 "train_batch_size": BIG_MBS * BIG_GAS, "steps_per_print": 1}
    engine, *_ = gpp_deepspeed.initialize(model=module, optimizer=torch.optim.SGD(params, lr=1e-4),
                                          model_parameters=params, config=ds_config)
    after_init = _status("VmHWM")
    losses, step_s = [], []
    for step in range(BIG_STEPS):
        t0 = time.perf_counter()
        losses.append(engine.train_batch(iter(_batches(config.vocab_size, BIG_SEQ, BIG_MBS, BIG_GAS, step))).item())
        step_s.append(time.perf_counter() - t0)
    after_train = _status("VmHWM")
    report = engine.memory_report()
    torch.distributed.barrier()
    saved = save_pretrained(engine, dst, captured)
    after_save = _status("VmHWM")
    mine = [m for m in report.ranks if m.rank == rank][0]
    (out / f"big.rank{rank}.json").write_text(json.dumps({
        "rank": rank, "stage": engine.stage_id, "imports": imports, "after_load": after_load,
        "after_init": after_init, "after_train": after_train, "after_save": after_save, "load_s": load_s,
        "save_s": saved["seconds"], "saved_bytes": saved["bytes"], "losses": losses, "step_s": step_s,
        "memory": dataclasses.asdict(mine), "layers": list(module.local_layer_names())}))
    torch.distributed.barrier()


def check_saved(src: Path, dst: Path) -> dict:
    """The saved directory against the loaded one, read lazily: the same names and shapes, and trained
    tensors that moved (SGD changed every tensor that got a gradient)."""
    from safetensors import safe_open
    a = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    b = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(a) == set(b), (sorted(set(a) ^ set(b))[:5])
    moved = {}
    for name in ("model.embed_tokens.weight", "model.layers.13.mlp.down_proj.weight", "lm_head.weight"):
        with safe_open(src / a[name], framework="pt") as f, safe_open(dst / b[name], framework="pt") as g:
            x, y = f.get_tensor(name), g.get_tensor(name)
            assert x.shape == y.shape
            moved[name] = float((x - y).abs().max())
    return {"names": len(b), "files": len(set(b.values())), "max_change": moved}


def run_big(tmp: Path) -> dict:
    src, dst = Path(tempfile.mkdtemp(prefix="gpp_big_in_", dir="/tmp")), None
    shutil.rmtree(src)
    try:
        written = write_big_directory(src)
        print(f"wrote {written['bytes'] / 2**30:.2f} GiB in {written['seconds']:.0f} s, writer peak "
              f"{written['peak'] / MIB:.0f} MiB", flush=True)
        dst = Path(tempfile.mkdtemp(prefix="gpp_big_out_", dir="/tmp"))
        _launch(BIG_RANKS, "--worker", "big", str(src), str(dst), str(tmp), timeout=3600, log_dir=tmp / "logs_big")
        ranks = sorted((json.loads((tmp / f"big.rank{r}.json").read_text()) for r in range(BIG_RANKS)),
                       key=lambda d: d["stage"])
        check = check_saved(src, dst)
        return {"written": written, "ranks": ranks, "check": check, "model_bytes": written["bytes"]}
    finally:
        shutil.rmtree(src, ignore_errors=True)
        if dst is not None:
            shutil.rmtree(dst, ignore_errors=True)


def _big_table(data: dict) -> str:
    total = data["model_bytes"]
    lines = [f"Model: {total / 4 / 1e9:.2f} B parameters, {total / 2**30:.2f} GiB in fp32; written as a sharded "
             f"directory layer by layer in {data['written']['seconds']:.0f} s (writer peak "
             f"{data['written']['peak'] / MIB:.0f} MiB). Saved directory: {data['check']['names']} tensors in "
             f"{data['check']['files']} shards, names and shapes equal to the loaded one's.", "",
             "| stage | layers | stage parameters (MiB) | share of the model | peak above imports after load / "
             "initialize / 3 steps / save (MiB) | peak / stage parameters | load (s) | save (s) | step (s, median) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for d in data["ranks"]:
        p = d["memory"]["param_bytes"]
        peaks = [d[k] - d["imports"] for k in ("after_load", "after_init", "after_train", "after_save")]
        lines.append(f"| {d['stage']} | {len(d['layers'])} | {p / MIB:.0f} | {p / total:.1%} | "
                     + " / ".join(f"{x / MIB:.0f}" for x in peaks)
                     + f" | {peaks[-1] / p:.2f}x | {d['load_s']:.1f} | {d['save_s']:.1f} | "
                     f"{statistics.median(d['step_s']):.0f} |")
    losses = data["ranks"][0]["losses"]
    lines += ["", f"Losses of the 3 steps: {', '.join(f'{x:.4f}' for x in losses)}. Largest change of three saved "
              "tensors against the loaded ones: " + ", ".join(f"`{k}` {v:.2e}" for k, v in data['check']['max_change'].items())
              + "."]
    return "\n".join(lines)


# -- report --------------------------------------------------------------------------------------------

def write_report(results: dict) -> None:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "large_models.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    results = {**old, **results}
    path.write_text(json.dumps(results, indent=1))
    parts = ["## Large models: memory per rank, the planner's memory model, a 1.5 B model in and out (measured)", "",
             "`python benchmarks/large_models.py` (CPU, gloo, `OMP_NUM_THREADS=1`; other "
             "engineers' tests shared the 2-core machine, which moves times, not memory). Peaks are each rank's `VmHWM` above its resident "
             "memory after imports (torch, DeepSpeed, transformers: about 370 MiB per rank)."]
    if "init" in results:
        parts += ["", "### Peak memory per rank at `initialize`: a Llama built on every rank (`real`, before), on the "
                  "meta device (`meta`), and as `GraphLayerSpec`s (`specs`)", "",
                  "4 ranks, 4 stages, `partition_method=\"parameters\"`, SGD. The slope is the growth of the peak per "
                  "byte of the stage's parameters between the two sizes; the fixed cost is what is left at zero "
                  "parameters (capture's tracing, DeepSpeed's engine, gloo).", "", _init_table(results["init"])]
    if "model" in results:
        parts += ["", "### The planner's memory model against measured peaks per stage", "",
                  f"Llama, hidden 512, 8 layers, vocabulary 8000, {MODEL_SEQ} tokens, micro-batch {MODEL_MBS}, "
                  f"{MODEL_GAS} micro-batches, 1F1B, Adam, 4 ranks; measured by the engine's memory report after "
                  f"{MODEL_STEPS} steps (MiB). The planner prices a stage as GraphPipe does: parameters x (1 + "
                  "optimizer factor 3: a gradient and two moments) + micro-batches in flight x stashed bytes "
                  "(profiled per layer by `profile_layers`).", "", _model_table(results["model"])]
    if "big" in results:
        parts += ["", "### 1.5 B parameters on 8 CPU ranks of a 24 GB machine: loaded, trained 3 steps, saved", "",
                  f"8 ranks, 8 stages, plain SGD, micro-batch {BIG_MBS} x {BIG_SEQ} tokens, {BIG_GAS} micro-batches. "
                  "Load: from `capture` to a built `GraphPipelineModule` (each rank reads its stage's tensors); "
                  "save: `save_pretrained`, every stage writing its shards at once.", "", _big_table(results["big"])]
    (RESULTS / "large_models.md").write_text("\n".join(parts) + "\n")
    print(f"wrote {RESULTS / 'large_models.md'}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default="init,model,big")
    parser.add_argument("--worker", nargs="+")
    args = parser.parse_args()
    if args.worker:
        kind, *rest = args.worker
        if kind == "model":
            model_worker(Path(rest[0]))
        else:
            big_worker(*map(Path, rest))
        return
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="gpp_large_") as tmp:
        results = {}
        for part in args.only.split(","):
            results[part] = {"init": run_init, "model": run_model, "big": run_big}[part](Path(tmp))
            write_report(results)
    from report import main as assemble
    assemble()


if __name__ == "__main__":
    main()
