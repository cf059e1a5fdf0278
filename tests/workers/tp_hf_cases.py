"""Worker: a captured tiny Llama with its decoder layers split over one TP group of 2 gloo ranks.

Run by ``tests/test_tp_hf.py`` through ``tests/dist.py`` (no pipeline engine: the whole model is
one :class:`~gpp_deepspeed.GraphModel` on every rank, its decoder layers built split by
:class:`~gpp_deepspeed.engine.tensor_parallel.HFTensorParallel` over the world):

    python tp_hf_cases.py grads OUT          # logits, loss and every gradient, split ones gathered
    python tp_hf_cases.py zero1 OUT          # STEPS steps of DeepSpeed's engine under ZeRO-1; parameters gathered
    python tp_hf_cases.py load IN OUT        # load_pretrained(IN) on the meta device: what was read, logits

Each writes ``OUT/<case>.rank<r>.pt``; cases joined by ``+`` run in turn in one launch
(``grads OUT + zero1 OUT + load IN OUT``, as the test runs them).
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tp_llama import LR, STEPS, TP_CONFIG, capture_tp_llama, loss_of, step_batches


def split_model(captured, group):
    """The captured model's GraphModel with its decoder layers built split over ``group``."""
    from gpp_deepspeed.engine.tensor_parallel import sharding_specs
    decoders = [s for s in captured.layers if ".layers." in s.name.replace("_", ".")]
    assert decoders, [s.name for s in captured.layers]
    with sharding_specs(decoders, group):
        return captured.graph_model()


def whole(module, tensors: dict) -> dict:
    """``tensors`` (by name in module) whole: each split one all-gathered along its split dim."""
    from gpp_deepspeed.engine.tensor_parallel import HFTensorParallel
    cuts = {}
    for name, sub in module.named_modules():
        if hasattr(sub, "tp_world_size"):
            for local, (dim, _, _) in HFTensorParallel(dist.group.WORLD).slices(sub).items():
                cuts[f"{name}.{local}"] = dim
    out = {}
    for name, t in tensors.items():
        if name in cuts:
            parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, t.contiguous())
            t = torch.cat(parts, dim=cuts[name])
        out[name] = t.detach().clone()
    return out


def run_grads(out: Path, rank: int) -> None:
    model = split_model(capture_tp_llama(meta=False), dist.group.WORLD)
    ids, labels = step_batches(0)[0]
    logits = model(ids)
    loss = loss_of(logits, labels)
    loss.backward()
    grads = whole(model, {n: p.grad for n, p in model.named_parameters()})
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    torch.save({"logits": logits.detach(), "loss": loss.item(), "grads": grads, "shapes": shapes},
               out / f"grads.rank{rank}.pt")


class _TPMpu:
    """DeepSpeed's ``mpu`` for a TP group that is the whole world (data-parallel degree 1)."""

    def __init__(self):
        self.single = [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]

    def get_model_parallel_group(self): return dist.group.WORLD
    def get_model_parallel_rank(self): return dist.get_rank()
    def get_model_parallel_world_size(self): return dist.get_world_size()
    def get_data_parallel_group(self): return self.single
    def get_data_parallel_rank(self): return 0
    def get_data_parallel_world_size(self): return 1


class _WithLoss(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, labels):
        return loss_of(self.model(ids), labels)


def run_zero1(out: Path, rank: int) -> None:
    import deepspeed
    model = _WithLoss(split_model(capture_tp_llama(meta=False), dist.group.WORLD))
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
              "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0}
    params = list(model.parameters())
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(params, lr=LR), model_parameters=params,
                                      config=config, mpu=_TPMpu())
    flat = type(engine.optimizer).__name__
    losses = []
    for step in range(STEPS):
        ids, labels = step_batches(step)[0]
        loss = engine(ids, labels)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    params = whole(model.model, dict(model.model.named_parameters()))
    torch.save({"losses": losses, "params": params, "optimizer": flat}, out / f"zero1.rank{rank}.pt")


def run_load(src: Path, out: Path, rank: int) -> None:
    import safetensors
    from gpp_deepspeed import load_pretrained

    read: list[tuple[str, tuple[int, ...]]] = []
    real_open = safetensors.safe_open

    class Recorded:
        """``safe_open`` that records the shape of every tensor handed out, whole or sliced."""

        def __init__(self, *args, **kwargs):
            self.file = real_open(*args, **kwargs)

        def __enter__(self):
            self.file.__enter__()
            return self

        def __exit__(self, *exc):
            return self.file.__exit__(*exc)

        def get_tensor(self, name):
            t = self.file.get_tensor(name)
            read.append((name, tuple(t.shape)))
            return t

        def get_slice(self, name):
            inner = self.file.get_slice(name)

            class Sliced:
                def __getitem__(self, index):
                    t = inner[index]
                    read.append((name, tuple(t.shape)))
                    return t

                def __getattr__(self, attr):
                    return getattr(inner, attr)
            return Sliced()

        def __getattr__(self, name):
            return getattr(self.file, name)

    captured = load_pretrained(capture_tp_llama(meta=True, config_dir=src), src)
    safetensors.safe_open = Recorded
    model = split_model(captured, dist.group.WORLD)
    safetensors.safe_open = real_open
    ids, labels = step_batches(0)[0]
    logits = model(ids)
    from gpp_deepspeed.engine.tensor_parallel import gathered
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    with gathered(model):   # what save_pretrained writes: whole tensors
        whole_state = {n: p.detach().clone() for n, p in model.named_parameters()}
    split_again = all(tuple(p.shape) == shapes[n] for n, p in model.named_parameters())
    torch.save({"read": read, "logits": logits.detach(), "whole": whole_state, "split_again": split_again, "meta_left": [n for n, p in model.named_parameters() if p.is_meta],
                "marked": sorted(n for n, p in model.named_parameters() if getattr(p, "tensor_model_parallel", False))},
               out / f"load.rank{rank}.pt")


def main() -> None:
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    from dist import runs   # tests/dist.py (``dist`` here is torch.distributed)
    rank = dist.get_rank()
    for case, *paths in runs(sys.argv[1:]):   # several cases joined by "+": one launch
        {"grads": run_grads, "zero1": run_zero1, "load": run_load}[case](*map(Path, paths), rank)
        dist.barrier()


if __name__ == "__main__":
    main()
