"""gpp_deepspeed: graph pipeline parallelism (GraphPipe, arXiv 2406.17145) for DeepSpeed.

Train a model whose layers form a DAG as a DAG of pipeline stages; independent branches run
concurrently on different ranks. ::

    model = GraphPipelineModule(layers=[GraphLayerSpec("a", nn.Linear, 8, 8, inputs=["x"]), ...],
                                input_names=["x"], num_stages=3, loss_fn=nn.MSELoss())
    engine, *_ = gpp_deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config="ds_config.json")
    loss = engine.train_batch(data_iter)
"""

from .config import GraphPipelineConfig
from .engine import GraphPipelineEngine, GraphPipelineModule
from .errors import GPPConfigError, GPPError, GraphError, PartitionError, ScheduleError
from .initialize import initialize
from .model import GraphModel
from .spec import GraphLayerSpec

__version__ = "0.1.0"

__all__ = [
    "GraphLayerSpec", "GraphModel", "GraphPipelineModule", "GraphPipelineEngine", "GraphPipelineConfig",
    "initialize", "GPPError", "GPPConfigError", "GraphError", "PartitionError", "ScheduleError",
]
