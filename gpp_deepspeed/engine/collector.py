"""When Python's cyclic garbage collector runs on a pipeline rank.

A full collection scans every object the process holds: with torch, DeepSpeed and a model built
that is a few hundred thousand objects, 0.2-1 s on a CPU of this machine's class
(``benchmarks/gc_pauses.py``). The interpreter starts one where the step's allocations happen to
cross its thresholds: on one rank, in the middle of a pipelined batch, and every rank that waits
for that rank's activations or gradients waits with it. On peers.py's four branches (8 ranks,
``zbv``) steps of 1.05-1.09 s took 1.30-1.57 s in each of the three steps in which one rank collected
(two or three ranks a step, always the same ones, the same actions: the collector is
deterministic). Two settings, the practice of Megatron-LM (``--manual-gc``), torchtitan
(``gc_freq``) and vLLM (a frozen heap after start-up):

``graph_pipeline.gc_freeze`` (default on)
    At the end of ``initialize``: one full collection, then ``gc.freeze()``. Every object made at
    start-up (the framework, the model, the engine and its programs) moves to the collector's
    permanent generation, which later collections never scan, so a full collection costs what the
    steps allocated since (milliseconds). Reference counting still frees every object when its
    last reference goes; only cyclic garbage made before the freeze and dropped after it is never
    collected.
DeepSpeed's ``"disable_python_gc": true`` with ``graph_pipeline.gc_interval``
    DeepSpeed turns the automatic collector off for the engine's lifetime
    (``deepspeed.runtime.python_gc``) and leaves collecting to the application
    (``engine.collect_python_gc()``). ``gc_interval = N`` does it for the application: after every
    N-th optimizer step every rank collects, at the same point between batches, where no rank
    waits for another (Megatron-LM's ``--manual-gc-interval``); 0 leaves it to the application.

Both act on the whole process (the collector is one per interpreter), as DeepSpeed's setting does.
"""

from __future__ import annotations

import gc
import time

from ..errors import GPPConfigError

__all__ = ["StepCollector", "check_gc_config", "freeze_startup_heap"]


def check_gc_config(ds_config: dict, gc_interval: int) -> None:
    """Refuse a collection interval without DeepSpeed's ``disable_python_gc``: with the automatic
    collector on, collections fall wherever the interpreter decides and the interval does not
    say when they happen."""
    if gc_interval and not ds_config.get("disable_python_gc", False):
        raise GPPConfigError(f'graph_pipeline.gc_interval = {gc_interval} collects every {gc_interval} steps in place '
                             'of Python\'s automatic collector, which is on: set "disable_python_gc": true in the '
                             "DeepSpeed config as well, or drop gc_interval")


def freeze_startup_heap() -> float:
    """Collect once, then move every object alive to the collector's permanent generation
    (``gc.freeze()``); returns the seconds it took."""
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    return time.perf_counter() - start


class StepCollector:
    """Every ``interval`` optimizer steps, DeepSpeed's ``engine.collect_python_gc()`` on this
    rank (``interval`` 0: never); ``last_s`` is the last collection's seconds."""

    def __init__(self, engine, interval: int):
        self.engine = engine
        self.interval = interval
        self.collections = 0
        self.last_s: float | None = None

    def after_step(self) -> None:
        """Called after every training batch (the optimizer step is in it)."""
        if not self.interval or self.engine.global_steps % self.interval:
            return
        start = time.perf_counter()
        self.engine.collect_python_gc()
        self.last_s = time.perf_counter() - start
        self.collections += 1
