"""Worker: capture each named case of ``tests/hf_models.py`` or ``tests/corpus_models.py``, train it pipelined,
save losses and parameters (named as in the original module).

Run by ``tests/test_hf_capture.py`` and ``tests/test_capture_corpus.py`` through ``tests/dist.py``: ``python hf_cases.py OUT_DIR CASE...``;
writes ``OUT_DIR/<case>.rank<r>.pt``. One launch runs several cases one after the other.
"""

import sys
import warnings
from pathlib import Path

import torch

from hf_models import CASES, GAS, LR, MBS, STEPS

try:   # the regression corpus of issue 30 (diffusers comes with the [hf] extra)
    from corpus_models import CORPUS
    CASES = {**CASES, **CORPUS}
except ImportError:
    pass


def run_case(name: str, out: Path, rank: int, world_size: int) -> None:
    import gpp_deepspeed
    from gpp_deepspeed import GraphPipelineModule
    from gpp_deepspeed.errors import GPPConfigError

    case = CASES[name]
    captured = case.capture(case.model())
    module = GraphPipelineModule(captured.layers, input_names=captured.input_names, output=captured.output,
                                 num_stages=case.stages, loss_fn=case.loss_fn, partition_method=case.partition_method(captured),
                                 stage_degrees=case.stage_degrees)
    params = [p for p in module.parameters() if p.requires_grad]
    replicas = world_size // sum(case.stage_degrees or (1, ) * case.stages)
    config = {"train_micro_batch_size_per_gpu": MBS, "gradient_accumulation_steps": GAS,
              "train_batch_size": MBS * GAS * replicas, "steps_per_print": 10**6, "gradient_clipping": 1.0,
              "graph_pipeline": {"print_stage_graph": rank == 0}}
    try:
        engine, _, _, _ = gpp_deepspeed.initialize(model=module, optimizer=torch.optim.SGD(params, lr=LR),
                                                   model_parameters=params, config=config)
    except GPPConfigError as refused:   # a refusal the test expects: every rank must give it
        torch.save({"stage": module.stage_id, "refused": str(refused)}, out / f"{name}.rank{rank}.pt")
        return
    losses = [engine.train_batch(data_iter=iter(case.batches(step))).item() for step in range(STEPS)]
    state = {k: v.detach().clone() for k, v in module.graph_state_dict().items()}
    torch.save({"stage": engine.stage_id, "losses": losses, "state": captured.module_state_dict(state),
                "layers": list(module.local_layer_names()),
                # what the last batch ran: each kind of action, transfers with their peer stage
                "ran": sorted({op.kind.value + ("" if op.peer is None else f"@{op.peer}")
                               for a, _, _ in engine.last_timeline for op in (a.ops or (a, ))}),
                "frozen": sorted(engine.stage_graph.frozen), "tied": sorted(module.tied_comms)},
               out / f"{name}.rank{rank}.pt")


def run_case_recording_warnings(name: str, out: Path, rank: int, world_size: int) -> None:
    """:func:`run_case`, with the warnings it raised (construction, training) saved beside its results."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_case(name, out, rank, world_size)
    path = out / f"{name}.rank{rank}.pt"
    result = torch.load(path)
    result["warnings"] = [str(w.message) for w in caught]
    torch.save(result, path)


def main():
    import deepspeed
    out = Path(sys.argv[1])
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    for name in sys.argv[2:]:
        run_case_recording_warnings(name, out, rank, world_size)
        torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
