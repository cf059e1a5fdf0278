"""gpp_deepspeed: graph pipeline parallelism (GraphPipe, arXiv 2406.17145) for DeepSpeed.

Train a model whose layers form a DAG as a DAG of pipeline stages; independent branches run
concurrently on different ranks. ::

    model = GraphPipelineModule(layers=[GraphLayerSpec("a", nn.Linear, 8, 8, inputs=["x"]), ...],
                                input_names=["x"], num_stages=3, loss_fn=nn.MSELoss())
    engine, *_ = gpp_deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config="ds_config.json")
    loss = engine.train_batch(data_iter)

The torch- and deepspeed-facing names load on first use, so the pure subpackages
(``gpp_deepspeed.graph``, ``gpp_deepspeed.schedule``) import without torch or deepspeed.
"""


from ._lazy import lazy_names
from .errors import CheckpointError, GPPConfigError, GPPError, GraphError, PartitionError, ScheduleError

__version__ = "0.1.0"

_LAZY = {
    "GraphLayerSpec": ".spec",
    "GraphModel": ".model",
    "GraphPipelineModule": ".engine",
    "GraphPipelineEngine": ".engine",
    "GraphPipelineConfig": ".config",
    "initialize": ".engine.initialize",
    "load_config": ".config",
    "capture": ".frontend",
    "load_pretrained": ".frontend",
    "save_pretrained": ".engine.pretrained",
}

__all__ = [
    "GraphLayerSpec", "GraphModel", "GraphPipelineModule", "GraphPipelineEngine", "GraphPipelineConfig",
    "initialize", "load_config", "capture", "load_pretrained", "save_pretrained", "GPPError", "GPPConfigError",
    "GraphError", "PartitionError", "CheckpointError", "ScheduleError",
]


__getattr__, __dir__ = lazy_names(__name__, _LAZY, __all__, globals_=globals())
