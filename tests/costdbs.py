"""Synthetic cost databases for planner tests: exact numbers, so results can be hand-checked."""

from __future__ import annotations

from gpp_deepspeed.planner import CommFit, CostDB, Hardware, LayerCost

FREE = CommFit(alpha_s=0.0, beta_s_per_byte=0.0)


def hardware(*, memory_bytes: float = 1e18, devices_per_node: int = 8, link: CommFit = FREE,
             optimizer_factor: float = 0.0) -> Hardware:
    return Hardware(name="synthetic", memory_bytes=int(memory_bytes), devices_per_node=devices_per_node,
                    intra=link, inter=link, optimizer_factor=optimizer_factor)


def synthetic_db(layers, *, inputs=("x",), fwd=None, bwd=None, param_bytes=None, out_bytes=None,
                 stash_bytes=None, micro_batches=(1, 2, 4, 8, 16, 32, 64), hw: Hardware | None = None,
                 model: str = "synthetic") -> CostDB:
    """A CostDB whose layer times scale exactly with the micro-batch: ``fwd[name] * b`` seconds.

    ``layers`` is ``[(name, [inputs...]), ...]`` in a topological order.
    """
    def get(table, name, default):
        return default if table is None else table.get(name, default)

    costs = tuple(LayerCost(
        name=name, inputs=tuple(ins), micro_batches=tuple(micro_batches),
        fwd_s=tuple(get(fwd, name, 1.0) * b for b in micro_batches),
        bwd_s=tuple(get(bwd, name, 2.0) * b for b in micro_batches),
        param_bytes=int(get(param_bytes, name, 0)), out_bytes=int(get(out_bytes, name, 0)),
        stash_bytes=int(get(stash_bytes, name, 0)))
        for name, ins in layers)
    return CostDB(model=model, source="synthetic (tests)", input_names=tuple(inputs), output=layers[-1][0],
                  layers=costs, hardware=hw or hardware())


def chain(n: int, **kw) -> CostDB:
    names = [f"l{i}" for i in range(n)]
    return synthetic_db([(nm, ["x"] if i == 0 else [names[i - 1]]) for i, nm in enumerate(names)], **kw)


def branches(num_branches: int, length: int, **kw) -> CostDB:
    """``num_branches`` chains of ``length`` layers, each from its own input, concatenated by ``cat``."""
    layers, inputs = [], []
    for b in range(num_branches):
        inputs.append(f"in{b}")
        for i in range(length):
            layers.append((f"b{b}_{i}", [f"in{b}"] if i == 0 else [f"b{b}_{i - 1}"]))
    layers.append(("cat", [f"b{b}_{length - 1}" for b in range(num_branches)]))
    return synthetic_db(layers, inputs=tuple(inputs), **kw)
