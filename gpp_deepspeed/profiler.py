"""Measuring a model's layers and the links between devices into a :class:`~gpp_deepspeed.planner.costs.CostDB`.

Glossary
--------
layer profile
    Per layer and micro-batch size ``b``: forward and backward seconds (the median of ``repeats``
    runs after ``warmup``), the backward also measured split in two (input gradients, then weight
    gradients, as the zero-bubble schedules run it), plus parameter bytes, output bytes per sample and stashed bytes per
    sample (the tensors autograd saves for backward). GraphPipe prices stages by "profiling the
    execution time of each operator" (arXiv 2406.17145, Sec. 5).
link fit
    ``alpha + beta * bytes`` seconds for one one-way point-to-point message. It is fitted to
    ping-pong times between two real processes (GraphPipe Sec. 5: communication latency
    "extrapolated by affine functions").

Representative use::

    hw = measure_hardware()                       # about 10 s: two gloo processes ping-pong
    db = profile_layers(layers, input_names=["x"], make_inputs=lambda b: (torch.randn(b, 64),),
                        micro_batches=(1, 2, 4, 8), hardware=hw)
    db.save("costs.json")
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .errors import GPPConfigError, GPPError
from .graph.ir import TensorRef, build_layer_graph
from .planner.costs import CommFit, CostDB, Hardware, LayerCost
from .nn.dag import call_layer, run_layer, tensors_in
from .nn.split_backward import backward_input
from .spec import LayerEntry, build_entry, normalize_layers

__all__ = ["profile_layers", "profile_on_ranks", "fit_affine", "measure_p2p", "measure_hardware", "with_links",
           "P2P_SIZES"]

P2P_SIZES = tuple(2**k for k in range(10, 25, 2))  # 1 KiB .. 16 MiB, bytes


def profile_layers(layers: Sequence[Any], *, input_names: Sequence[str], output: str | None = None,
                   make_inputs: Callable[[int], Any], micro_batches: Sequence[int] = (1, 2, 4, 8),
                   device: str | torch.device = "cpu", warmup: int = 2, repeats: int = 5,
                   model_name: str = "model", hardware: Hardware | None = None,
                   only: Callable[[int, str], bool] | None = None) -> CostDB:
    """Measure every layer of a layer list on ``device`` and return its :class:`CostDB`.

    ``layers``, ``input_names`` and ``output`` are what ``GraphPipelineModule`` takes. ``make_inputs(b)``
    returns the graph inputs (a tensor or a tuple in ``input_names`` order) for a micro-batch of
    ``b`` samples. The layers are built one at a time, in the graph's order, under the build seeds
    a :class:`~gpp_deepspeed.GraphModel` gives them (a captured meta layer is materialised then,
    :mod:`gpp_deepspeed.frontend.meta`), and each is dropped once it has run (a tied module once its last
    entry has): the model is never whole, and what is live is one layer and the activations later
    layers still read. Each layer runs forward on what the layers before it produced, at every
    micro-batch size, and alone forward and backward (towards its inputs and parameters, with a
    random output gradient) on fresh copies of those inputs.

    Byte counts per sample are the largest over the measured sizes, so a part that does not grow
    with the batch is not under-counted at small micro-batches. A tensor saved by both its producer
    and its consumer counts in both layers: exact when they sit on different stages (the consumer
    stashes the copy it received), an over-estimate otherwise. The parameters of a
    ``TiedLayerSpec`` count once, at the key's first entry in the list; parameters hidden in a plain
    callable are invisible. ``hardware`` defaults to :func:`measure_hardware` on ``device``.
    ``only(index, name)`` picks the layers to time (the others get zero times; they are still built
    and run, for their outputs and bytes): :func:`profile_on_ranks` shares the layers among ranks
    with it.
    """
    mbs = tuple(sorted(set(int(b) for b in micro_batches)))
    if not mbs or mbs[0] <= 0 or warmup < 0 or repeats < 1:
        raise GPPConfigError(f"need positive micro_batches, warmup >= 0 and repeats >= 1, got "
                             f"micro_batches={list(micro_batches)}, warmup={warmup}, repeats={repeats}")
    device = torch.device(device)
    entries = normalize_layers(layers, input_names, base_seed=_BASE_SEED)
    graph = build_layer_graph(input_names, [(e.name, e.inputs) for e in entries], output=output)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    index = {e.name: i for i, e in enumerate(entries)}
    by_name = {e.name: e for e in entries}
    envs = {b: _graph_inputs(graph.input_names, make_inputs(b), device) for b in mbs}
    layers_alive = _LayerStream(entries, graph.order, device)
    costs: dict[str, LayerCost] = {}
    for name in graph.order:
        e = by_name[name]
        fn, params, buffers, count_params = layers_alive.build(e)
        timed = only is None or only(index[name], name)
        times, out_sizes, stash_sizes = [], [], []   # one each per micro-batch size, in order

        def measure(entry, layer_fn, args):
            times.append(_time_layer(entry, layer_fn, args, params, warmup=warmup, repeats=repeats, sync=sync)
                         if timed else (0.0,) * 4)
            out, stashed = _stash(entry, layer_fn, args, params + buffers)
            out_sizes.append(sum(t.numel() * t.element_size() for t in tensors_in(out)))
            stash_sizes.append(stashed)
            del out
            with torch.no_grad():   # the value later layers read, as GraphModel.forward computes it
                return call_layer(entry, layer_fn, args)

        for b in mbs:
            run_layer(envs[b], e, fn, call=measure)
        out_bytes = max(math.ceil(n / b) for n, b in zip(out_sizes, mbs))
        stash_bytes = max(math.ceil(n / b) for n, b in zip(stash_sizes, mbs))
        fwd, bwd, grad_in, grad_w = (tuple(t[k] for t in times) for k in range(4))
        costs[name] = LayerCost(name=name, inputs=tuple(e.inputs), micro_batches=mbs, fwd_s=fwd, bwd_s=bwd,
                                bwd_input_s=grad_in, bwd_weight_s=grad_w, out_bytes=out_bytes, stash_bytes=stash_bytes,
                                param_bytes=sum(p.numel() * p.element_size() for p in params) if count_params else 0)
        del fn, params, buffers
        for dead in layers_alive.done(name):
            for env in envs.values():
                env.pop(TensorRef(dead), None)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    return CostDB(model=model_name, source=f"measured on {where}, torch {torch.__version__}",
                  input_names=tuple(graph.input_names), output=graph.output,
                  layers=tuple(costs[e.name] for e in entries),
                  hardware=hardware if hardware is not None else measure_hardware(device=device))


_BASE_SEED = 1234   # GraphModel's and GraphPipelineModule's default: the same weights as training


class _LayerStream:
    """Builds :func:`profile_layers`' layers one at a time and says when a layer's output, or a tied
    module, is no longer needed (after the last layer in ``order`` that reads it)."""

    def __init__(self, entries: Sequence[LayerEntry], order: Sequence[str], device: torch.device):
        self.device = device
        by_name = {e.name: e for e in entries}
        self.last_reader: dict[str, str] = {}    # producer -> its last reader in order
        self.tie_last: dict[str, str] = {}       # tie key -> its last entry in order
        for name in order:
            for ref in by_name[name].inputs:
                self.last_reader[TensorRef.parse(ref).node] = name
            if by_name[name].tie_key is not None:
                self.tie_last[by_name[name].tie_key] = name
        self.readers_done: dict[str, list[str]] = {}
        for producer, reader in self.last_reader.items():
            self.readers_done.setdefault(reader, []).append(producer)
        self.tied: dict[str, nn.Module] = {}
        self.tie_counted: set[str] = set()
        self.entry_of = by_name

    def build(self, e: LayerEntry):
        """The layer's callable on the device, its parameters and buffers, and whether its
        parameters count here (a tie's count once, at its first entry)."""
        key = e.tie_key
        if key is not None:
            if key not in self.tied:
                self.tied[key] = build_entry(e).to(self.device)
            module = self.tied[key]
            fn = module if e.layer.forward_fn is None else functools.partial(e.layer.forward_fn, module)
            counted = key not in self.tie_counted
            self.tie_counted.add(key)
        else:
            built = build_entry(e)
            if isinstance(e.layer, nn.Module):   # the user's module stays where it is, untouched
                built = copy.deepcopy(built)
            module = built.to(self.device) if isinstance(built, nn.Module) else None
            fn, counted = module if module is not None else built, True
        if module is None:
            return fn, [], [], counted
        return fn, [p for p in module.parameters() if p.requires_grad], list(module.buffers()), counted

    def done(self, name: str) -> list[str]:
        """After ``name`` ran: drop a tie whose last entry it was; the outputs nobody reads any more."""
        key = self.entry_of[name].tie_key
        if key is not None and self.tie_last[key] == name:
            del self.tied[key]
        return self.readers_done.get(name, []) + ([name] if name not in self.last_reader else [])


def _graph_inputs(input_names: Sequence[str], inputs: Any, device: torch.device) -> dict[TensorRef, Any]:
    inputs = (inputs, ) if torch.is_tensor(inputs) else tuple(inputs)
    return {TensorRef(n): _map_tensors(lambda t: t.to(device), x) for n, x in zip(input_names, inputs)}


def profile_on_ranks(layers: Sequence[Any], *, input_names: Sequence[str], output: str | None = None,
                     profile, device: str | torch.device, group=None, model_name: str = "model") -> CostDB:
    """The cost database of a :class:`~gpp_deepspeed.partitioning.DeviceProfile`, measured by
    every rank of ``group`` (default: the world) on its own ``device`` and agreed: rank ``r``
    times layers ``r, r + W, r + 2W, ...`` (:func:`profile_layers`), the ranks exchange their rows
    (``all_gather_object``), and every rank assembles the same database. The links are ping-pongs
    between pairs of ranks on the running process group, inside a node and across nodes
    (:func:`_device_hardware`), the memory the device's (or this host's RAM shared by the ranks on
    it). Collective: call it on every rank of ``group``.

    Every rank builds the layers one at a time (:func:`profile_layers`): it runs each of them
    forward, for the inputs of the next, and times its share; the model is never whole on a rank.
    """
    device = torch.device(device)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    mine = profile_layers(layers, input_names=input_names, output=output, make_inputs=profile.make_inputs,
                          micro_batches=profile.micro_batches, device=device, warmup=profile.warmup,
                          repeats=profile.repeats, model_name=model_name, hardware=_device_hardware(device, group),
                          only=lambda index, name: index % world == rank)
    rows: list = [None] * world
    dist.all_gather_object(rows, [(c.fwd_s, c.bwd_s, c.bwd_input_s, c.bwd_weight_s) for c in mine.layers],
                           group=group)
    layers_out = tuple(dataclasses.replace(c, **dict(zip(("fwd_s", "bwd_s", "bwd_input_s", "bwd_weight_s"),
                                                         rows[index % world][index])))
                       for index, c in enumerate(mine.layers))
    source = f"{mine.source}; timed at start-up by {world} ranks"
    return dataclasses.replace(mine, layers=layers_out, source=source)


def _device_hardware(device: torch.device, group) -> Hardware:
    """This group's links and the device's memory, the same on every rank.

    The links are ping-pongs between pairs of ranks, every pair at once (as a pipeline's stages
    exchange at once): inside a node, each rank paired with its neighbour; across nodes (when the
    group spans several, ``LOCAL_SIZE`` ranks each), the k-th rank of a node with the k-th of the
    next. Each link is the affine fit (:func:`fit_affine`) of the median pair at each size, so one
    slow or fast pair does not stand for every link; a group inside one node has one link.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    local = int(os.environ.get("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", world)))
    nodes: dict[int, list[int]] = {}
    for r in ranks:
        nodes.setdefault(r // max(1, local), []).append(r)
    members = list(nodes.values())
    intra = [(m[i], m[i + 1]) for m in members for i in range(0, len(m) - 1, 2)]
    inter = [(a[k], b[k]) for a, b in zip(members[0::2], members[1::2]) for k in range(min(len(a), len(b)))]
    sizes = (1 << 10, 1 << 16, 1 << 20)
    fits = {}
    for label, pairs in (("intra", intra), ("inter", inter)):
        mine = _ping_pong(next((p for p in pairs if ranks[rank] in p), None), ranks[rank], sizes, device, group)
        everyone: list = [None] * world
        dist.all_gather_object(everyone, mine, group=group)
        measured = [t for t in everyone if t is not None]
        fits[label] = fit_affine(sizes, [statistics.median(t[i] for t in measured) for i in range(len(sizes))]) \
            if measured else None
    free = CommFit(alpha_s=0.0, beta_s_per_byte=0.0)
    intra_fit = fits["intra"] or fits["inter"] or free
    if device.type == "cuda":
        memory, label = torch.cuda.get_device_properties(device).total_memory, torch.cuda.get_device_name(device)
    else:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(1, min(local, world))
        label = f"cpu ({os.cpu_count()} cores)"
    memory_all = [memory]
    dist.broadcast_object_list(memory_all, src=ranks[0], group=group)
    where = f"{len(intra)} pairs inside a node" + (f", {len(inter)} across nodes" if inter else "")
    return Hardware(name=f"{label}; links timed at start-up between {where}, the median pair",
                    memory_bytes=int(memory_all[0]), devices_per_node=min(local, world), intra=intra_fit,
                    inter=fits["inter"] or intra_fit)


def _ping_pong(pair: tuple[int, int] | None, me: int, sizes: Sequence[int], device: torch.device,
               group) -> list[float] | None:
    """Half the median round trip at each size between the ranks of ``pair`` (global ranks), the
    first sending first; None for a rank in no pair."""
    if pair is None:
        return None
    peer = pair[1] if me == pair[0] else pair[0]
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    seconds = []
    for nbytes in sizes:
        buf = torch.zeros(nbytes // 4, device=device)
        times = []
        for i in range(6):
            sync()
            t0 = time.perf_counter()
            if me == pair[0]:
                dist.send(buf, peer, group=group)
                dist.recv(buf, peer, group=group)
            else:
                dist.recv(buf, peer, group=group)
                dist.send(buf, peer, group=group)
            sync()
            if i:
                times.append((time.perf_counter() - t0) / 2)
        seconds.append(statistics.median(times))
    return seconds


def _map_tensors(fn: Callable, value: Any) -> Any:
    if torch.is_tensor(value):
        return fn(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_map_tensors(fn, v) for v in value)
    return value


def _fresh_inputs(args: list) -> tuple[list, list[torch.Tensor]]:
    """Copies of a layer's arguments to call it on, and the leaves to differentiate towards.

    Float tensors become leaves that require grad, and the layer gets a clone of each: a leaf
    cannot be modified in place (``nn.ReLU(inplace=True)``), and the captured values stay intact.
    """
    leaves: list[torch.Tensor] = []

    def fresh(t):
        if not (t.is_floating_point() or t.is_complex()):
            return t.clone()
        leaves.append(t.detach().requires_grad_())
        return leaves[-1].clone()

    return _map_tensors(fresh, args), leaves


def _time_layer(entry: LayerEntry, fn: Callable, args: list, params: list, *, warmup: int, repeats: int,
                sync: Callable) -> tuple[float, float, float, float]:
    """Median seconds of one layer on fixed inputs: forward, fused backward, and the two halves
    of the split backward the zero-bubble schedules run (input gradients ``I``, then weight
    gradients ``W``, by the split the engine runs, :mod:`~gpp_deepspeed.nn.split_backward`)."""
    fwd, bwd, grad_in, grad_w = [], [], [], []
    for i in range(warmup + repeats):
        xs, leaves = _fresh_inputs(args)
        wrt = leaves + params
        sync()
        t0 = time.perf_counter()
        out = call_layer(entry, fn, xs)
        sync()
        t1 = time.perf_counter()
        outs = [t for t in tensors_in(out) if t.requires_grad]
        back = split_in = split_w = 0.0
        if outs and wrt:
            grads = [torch.randn_like(t) for t in outs]
            sync()
            t2 = time.perf_counter()
            torch.autograd.grad(outs, wrt, grads, allow_unused=True, retain_graph=True)
            sync()
            t3 = time.perf_counter()
            work = backward_input(outs, grads, inputs=leaves, params=params)
            sync()
            t4 = time.perf_counter()
            work.run()
            sync()
            back, split_in, split_w = t3 - t2, t4 - t3, time.perf_counter() - t4
            for p in params:  # the split accumulates into .grad; the profile must not change the model
                p.grad = None
        if i >= warmup:
            fwd.append(t1 - t0)
            bwd.append(back)
            grad_in.append(split_in)
            grad_w.append(split_w)
    return tuple(statistics.median(v) for v in (fwd, bwd, grad_in, grad_w))


def _stash(entry: LayerEntry, fn: Callable, args: list, skip: list) -> tuple[Any, int]:
    """A layer's output and the bytes autograd saves for its backward, parameters and buffers excluded."""
    # Dedupe by storage: a tensor and its views (x, x.t()) are one allocation kept alive once.
    seen = {_storage(t)[0] for t in skip}
    total = 0

    def pack(t):
        nonlocal total
        key, nbytes = _storage(t)
        if key not in seen:
            seen.add(key)
            total += nbytes
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = call_layer(entry, fn, _fresh_inputs(args)[0])
    return out, total


def _storage(t: torch.Tensor) -> tuple[Any, int]:
    try:
        s = t.untyped_storage()
        return (t.device, s.data_ptr()), s.nbytes()
    except (RuntimeError, NotImplementedError):  # tensor subclasses without a plain storage
        return id(t), t.numel() * t.element_size()


def fit_affine(sizes_bytes: Sequence[float], seconds: Sequence[float], *, relative: bool = True) -> CommFit:
    """Least-squares fit of ``seconds ~ alpha + beta * bytes``, with ``alpha, beta >= 0``.

    With ``relative`` (the default) each point is weighted by ``1 / seconds**2``, i.e. relative
    errors are minimised: the small messages then fix the latency and the large ones the
    bandwidth, where an unweighted fit lets millisecond noise on 16 MiB messages swamp a 50 us
    latency.

    >>> fit = fit_affine([0, 1000, 2000], [1e-5, 2e-5, 3e-5])
    >>> round(fit.alpha_s, 12), round(fit.beta_s_per_byte, 15)
    (1e-05, 1e-08)
    """
    xs, ys = [float(x) for x in sizes_bytes], [float(y) for y in seconds]
    if len(xs) != len(ys) or len(set(xs)) < 2:
        raise GPPConfigError(f"fit_affine needs as many times as sizes and at least two distinct sizes, "
                             f"got {len(xs)} sizes ({len(set(xs))} distinct) and {len(ys)} times")
    ws = [1.0 / y**2 for y in ys] if relative and min(ys) > 0 else [1.0] * len(ys)
    sw = sum(ws)
    sx = sum(w * x for w, x in zip(ws, xs))
    sy = sum(w * y for w, y in zip(ws, ys))
    sxx = sum(w * x * x for w, x in zip(ws, xs))
    sxy = sum(w * x * y for w, x, y in zip(ws, xs, ys))
    beta = (sw * sxy - sx * sy) / (sw * sxx - sx * sx)
    alpha = (sy - beta * sx) / sw
    if alpha < 0:  # refit through the origin
        alpha, beta = 0.0, sxy / sxx
    if beta < 0:  # time does not grow with size: a pure latency
        alpha, beta = max(0.0, sy / sw), 0.0
    return CommFit(alpha_s=alpha, beta_s_per_byte=beta)


def measure_p2p(*, backend: str = "gloo", sizes: Sequence[int] = P2P_SIZES, warmup: int = 2, repeats: int = 10,
                timeout_s: float = 120.0) -> CommFit:
    """Fit one-way send time between two processes on this machine (127.0.0.1).

    Rank 0 sends ``sizes[i]`` bytes of float32 to rank 1, which sends them back; half the median
    round trip is the one-way time. ``nccl`` puts the ranks on ``cuda:0`` and ``cuda:1``. Both
    processes are killed and :class:`GPPError` raised if one fails or ``timeout_s`` passes.
    """
    sizes = [int(s) for s in sizes]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "p2p.json"
        kw = dict(port=port, backend=backend, sizes=sizes, warmup=warmup, repeats=repeats, timeout_s=timeout_s,
                  result=str(result))
        _run_pair(kw, Path(tmp), timeout_s=timeout_s)
        seconds = json.loads(result.read_text())
    return fit_affine(sizes, seconds)


def _run_pair(kw: dict, log_dir: Path, *, timeout_s: float) -> None:
    """Run ``_p2p_worker(rank=r, **kw)`` for r = 0, 1 in fresh interpreters; kill both on a failure or timeout."""
    # Fresh interpreters rather than multiprocessing's spawn, which re-runs the caller's script
    # unless it is guarded by ``if __name__ == "__main__"``.
    code = "import json, sys; from gpp_deepspeed.profiler import _p2p_worker; _p2p_worker(**json.loads(sys.argv[1]))"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parent.parent),
                                                       os.environ.get("PYTHONPATH", "")]))
    logs = [log_dir / f"rank{rank}.log" for rank in range(2)]
    procs = []
    try:
        for rank, log in enumerate(logs):
            with open(log, "w") as out:
                procs.append(subprocess.Popen([sys.executable, "-c", code, json.dumps(dict(kw, rank=rank))],
                                              env=env, stdout=out, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    if any(p.returncode != 0 for p in procs):
        tails = "\n".join(f"--- rank {r} (exit code {p.returncode}) ---\n{log.read_text()[-2000:]}"
                          for r, (p, log) in enumerate(zip(procs, logs)))
        raise GPPError(f"the {kw['backend']} p2p measurement failed or did not finish in {timeout_s:.0f} s "
                       f"(raise timeout_s, or measure fewer or smaller sizes):\n{tails}")


def _p2p_worker(rank: int, port: int, backend: str, sizes: tuple, warmup: int, repeats: int, timeout_s: float,
                result: str) -> None:
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=timeout_s))
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    one_way = []
    try:
        dist.barrier()  # both ranks past their set-up before the first timed message
        for nbytes in sizes:
            buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
            times = []
            for _ in range(warmup + repeats):
                sync()
                t0 = time.perf_counter()
                if rank == 0:
                    dist.send(buf, 1)
                    dist.recv(buf, 1)
                else:
                    dist.recv(buf, 0)
                    dist.send(buf, 0)
                sync()
                times.append(time.perf_counter() - t0)
            one_way.append(statistics.median(times[warmup:]) / 2)
        if rank == 0:
            Path(result).write_text(json.dumps(one_way))
    finally:
        dist.destroy_process_group()


def measure_hardware(*, device: str | torch.device = "cpu", backend: str | None = None,
                     devices_per_node: int | None = None, sizes: Sequence[int] = P2P_SIZES, repeats: int = 10,
                     timeout_s: float = 120.0) -> Hardware:
    """This machine as a :class:`Hardware`, with ``intra`` and ``inter`` both the measured p2p fit.

    One machine cannot measure a link between nodes, so ``inter == intra`` and the name says so;
    on a cluster, measure across two nodes and substitute it with :func:`with_links`. Memory per
    device: the GPU's total memory, or on CPU the physical memory (``MemTotal``) divided by
    ``devices_per_node`` (default: the GPU count, or 1 on CPU, i.e. one rank per machine).
    ``backend`` defaults to nccl with two or more GPUs, else gloo.
    """
    device = torch.device(device)
    if device.type == "cuda":
        num = devices_per_node or torch.cuda.device_count()
        memory = torch.cuda.get_device_properties(device).total_memory
        backend = backend or ("nccl" if torch.cuda.device_count() >= 2 else "gloo")
        label = torch.cuda.get_device_name(device)
        if backend == "gloo":
            warnings.warn("measuring the links with gloo between CPU tensors: this machine has fewer than two "
                          "GPUs, so the fit is loopback TCP, not the GPU interconnect; replace it with "
                          "with_links() from a multi-GPU measurement")
    else:
        num = devices_per_node or 1
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // num  # MemTotal on Linux
        backend = backend or "gloo"
        label = f"cpu ({os.cpu_count()} cores)"
    fit = measure_p2p(backend=backend, sizes=sizes, repeats=repeats, timeout_s=timeout_s)
    return Hardware(name=f"{label} x{num}; {backend} p2p measured on one machine (inter = intra)",
                    memory_bytes=int(memory), devices_per_node=num, intra=fit, inter=fit)


def with_links(hardware: Hardware, *, intra: CommFit | None = None, inter: CommFit | None = None) -> Hardware:
    """``hardware`` with the given link fits substituted, e.g. ``inter`` measured across two nodes."""
    changed = [n for n, v in (("intra", intra), ("inter", inter)) if v is not None]
    if not changed:
        return hardware
    return dataclasses.replace(hardware, intra=intra or hardware.intra, inter=inter or hardware.inter,
                               name=f"{hardware.name}; {' and '.join(changed)} substituted")
