"""The planner: cost databases, GraphPipe's search, baselines, plans and their simulation.

Everything here is pure Python (no torch): profiles and plans are JSON, so planning for a GPU
cluster runs on a laptop.
"""

from .costs import (ZERO_STAGES, CommFit, CostDB, Hardware, LayerCost, StageCost, StageCostModel, micro_batch_sizes,
                    weight_state_bytes)
from .inflight import in_flight, stage_in_flight
from .plan import Plan, PlanStage, Prediction, SearchResult
from .search import graphpipe_partition, graphpipe_search
from .simulate import predict, simulate_plan
from .sp import Leaf, Parallel, Series, sp_decompose, sp_ize, sp_tree

__all__ = ["CommFit", "CostDB", "Hardware", "LayerCost", "StageCost", "StageCostModel", "micro_batch_sizes",
           "ZERO_STAGES", "weight_state_bytes",
           "in_flight", "stage_in_flight", "Plan", "PlanStage", "Prediction", "SearchResult",
           "graphpipe_partition", "graphpipe_search", "predict", "simulate_plan",
           "Leaf", "Parallel", "Series", "sp_decompose", "sp_ize", "sp_tree"]
