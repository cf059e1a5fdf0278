"""Worker: train a captured two-tower model on 2 pipeline stages; save losses and parameters.

Run by ``tests/test_capture.py`` through ``tests/dist.py``: ``python capture_worker.py OUT_DIR``.
Every rank builds the same model (same seed), captures it and writes ``OUT_DIR/rank<r>.pt``.
The model and data live here so the test's single-device reference uses the very same ones.
"""

import sys
from pathlib import Path

import torch
from torch import nn

STEPS, GAS, MBS, LR = 2, 2, 4, 0.1


class Tower(nn.Module):
    def __init__(self, features, hidden):
        super().__init__()
        self.proj = nn.Linear(features, hidden)
        self.out = nn.Linear(hidden, hidden)

    def forward(self, x):
        return self.out(torch.tanh(self.proj(x)))


class TwoTower(nn.Module):
    """An ordinary two-branch module: glue (cat, scaling) lives in forward."""

    def __init__(self, text=6, image=10, hidden=8, classes=3):
        super().__init__()
        self.text = Tower(text, hidden)
        self.image = Tower(image, hidden)
        self.head = nn.Linear(2 * hidden, classes)

    def forward(self, text, image):
        fused = torch.cat([self.text(text), 0.5 * self.image(image)], dim=-1)
        return self.head(torch.relu(fused))


def make_model():
    torch.manual_seed(0)
    return TwoTower()


def batches(step):
    g = torch.Generator().manual_seed(step)
    return [((torch.randn(MBS, 6, generator=g), torch.randn(MBS, 10, generator=g)),
             torch.randint(0, 3, (MBS, ), generator=g)) for _ in range(GAS)]


def main():
    import deepspeed
    import gpp_deepspeed
    from gpp_deepspeed import GraphPipelineModule
    from gpp_deepspeed.frontend import capture

    out = Path(sys.argv[1])
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    captured = capture(make_model())
    module = GraphPipelineModule(captured.layers, input_names=captured.input_names, output=captured.output,
                                 num_stages=2, loss_fn=nn.CrossEntropyLoss())
    params = [p for p in module.parameters() if p.requires_grad]
    config = {"train_micro_batch_size_per_gpu": MBS, "gradient_accumulation_steps": GAS, "train_batch_size": MBS * GAS,
              "steps_per_print": 10**6, "gradient_clipping": 1.0,
              "graph_pipeline": {"schedule": "1f1b", "print_stage_graph": False}}
    engine, _, _, _ = gpp_deepspeed.initialize(model=module, optimizer=torch.optim.SGD(params, lr=LR),
                                               model_parameters=params, config=config)
    losses = [engine.train_batch(data_iter=iter(batches(step))).item() for step in range(STEPS)]
    state = {k: v.detach().clone() for k, v in module.graph_state_dict().items()}
    torch.save({"stage": engine.stage_id, "losses": losses, "state": captured.module_state_dict(state),
                "layers": list(module.local_layer_names())}, out / f"rank{rank}.pt")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
