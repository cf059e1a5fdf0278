"""The planner: cost databases, GraphPipe's search, baselines, plans and their simulation.

Everything here is pure Python (no torch): profiles and plans are JSON, so planning for a GPU
cluster runs on a laptop.
"""

from .costs import CommFit, CostDB, Hardware, LayerCost, StageCost, StageCostModel, micro_batch_sizes

__all__ = ["CommFit", "CostDB", "Hardware", "LayerCost", "StageCost", "StageCostModel", "micro_batch_sizes"]
