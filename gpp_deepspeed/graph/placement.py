"""Placement: which ranks run which stage, and which rows of a micro-batch each of them holds.

GraphPipe gives every stage its own data-parallel degree (arXiv 2406.17145, Sec. 4: a stage is
a set of layers *and* a number of devices). This module is the arithmetic of that, pure.

Glossary
--------
degree
    ``n_s``: how many ranks run stage ``s`` inside one copy of the stage DAG. Each gets ``b / n_s``
    rows of every micro-batch of ``b`` samples.
replica
    One copy of the whole stage DAG on ``sum(n_s)`` ranks. A world of ``R * sum(n_s)`` ranks runs
    ``R`` replicas (outer data parallelism), each on its own micro-batches.
shard
    Rows ``[i * b / n, (i + 1) * b / n)`` of a micro-batch: what the ``i``-th rank (its *index*) of a
    stage of degree ``n`` holds.
tensor-parallel degree
    ``tp_s``: how many of a stage's ``n_s`` ranks hold one row shard between them, each with its
    slice of the stage's layers (Megatron-LM's tensor parallelism, arXiv 1909.08053). A stage's
    ``n_s`` ranks per replica are ``n_s / tp_s`` row shards (its data-parallel degree ``dp_s``) of
    ``tp_s`` adjacent ranks each (its TP groups), as Megatron and DeepSpeed's
    ``PipeModelDataParallelTopology`` lay them out: index ``i`` in the stage is row shard
    ``i // tp_s``, TP rank ``i % tp_s``.
transfer
    On a stage edge ``s -> t``: the rows ``[start, stop)`` of the micro-batch that rank index ``i``
    of ``s`` sends to rank index ``j`` of ``t`` (activations forward, their gradients backward). Each
    consumer receives exactly its rows, from the producers that hold them; nothing is gathered.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import GPPConfigError

__all__ = ["RowTransfer", "RankPlace", "Placement", "shard_rows", "reshard"]


@dataclass(frozen=True, slots=True)
class RowTransfer:
    """Rows ``[start, stop)`` of a micro-batch that producer index ``src_idx`` sends to consumer
    index ``dst_idx`` on one stage edge."""

    src_idx: int
    dst_idx: int
    start: int
    stop: int


def shard_rows(micro_batch: int, degree: int, idx: int) -> tuple[int, int]:
    """The rows ``[start, stop)`` that rank index ``idx`` of a stage of ``degree`` ranks holds.

    >>> shard_rows(8, 4, 1)
    (2, 4)
    """
    size = micro_batch // degree
    return idx * size, (idx + 1) * size


def reshard(micro_batch: int, *, num_src: int, num_dst: int) -> tuple[RowTransfer, ...]:
    """Every transfer of one stage edge from ``num_src`` producer ranks to ``num_dst`` consumer
    ranks, ordered by consumer, then by row (a consumer concatenates what it receives in order).

    ``micro_batch`` must be divisible by both degrees.

    >>> [(t.src_idx, t.dst_idx, t.start, t.stop) for t in reshard(6, num_src=2, num_dst=3)]
    [(0, 0, 0, 2), (0, 1, 2, 3), (1, 1, 3, 4), (1, 2, 4, 6)]
    >>> len(reshard(4, num_src=2, num_dst=2))   # equal degrees: index i sends its whole shard to i
    2
    """
    for n in (num_src, num_dst):
        if n < 1 or micro_batch % n:
            raise GPPConfigError(f"a micro-batch of {micro_batch} samples cannot be split into {n} equal shards")
    out = []
    for j in range(num_dst):
        lo, hi = shard_rows(micro_batch, num_dst, j)
        for i in range(num_src):
            s_lo, s_hi = shard_rows(micro_batch, num_src, i)
            start, stop = max(lo, s_lo), min(hi, s_hi)
            if start < stop:
                out.append(RowTransfer(i, j, start, stop))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class RankPlace:
    """Where one rank sits: its stage, its replica of the stage DAG, its index in the stage, and
    that index split into its row shard (``dp_idx``) and its rank in the shard's TP group."""

    stage: int
    replica: int
    idx: int
    dp_idx: int = 0
    tp_idx: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Placement:
    """Stage ``s`` on ``degrees[s]`` contiguous ranks in each of ``replicas`` copies of the DAG.

    Ranks are laid out stage by stage, as DeepSpeed's ``PipeDataParallelTopology`` lays them out
    (with every degree 1 the two agree rank for rank): the block of stage ``s`` holds its
    ``replicas * degrees[s]`` ranks, replica after replica, so a stage's ranks are contiguous and
    its gradient all-reduce stays as local as possible. ``order`` is the order of the stage blocks:
    stage order, except that a block that fits in one node (``local_size`` ranks) is not split
    across two when another order avoids it (see :meth:`build`).

    >>> p = Placement.build((2, 1, 1), world_size=8)
    >>> p.replicas, p.ranks(0, 0), p.ranks(0, 1), p.ranks(1, 1), p.locate(5)
    (2, (0, 1), (2, 3), (5,), RankPlace(stage=1, replica=1, idx=0, dp_idx=0, tp_idx=0))

    ``tp[s]`` ranks of stage ``s`` share each row shard (tensor parallelism; default 1 each):

    >>> q = Placement.build((2, 2, 2), world_size=6, tp=(2, 1, 2))
    >>> q.dp, q.tp_group(0, 0, 0), q.data_group(1, 0), q.data_group(2, 1), q.locate(5)
    ((1, 2, 1), (0, 1), (2, 3), (5,), RankPlace(stage=2, replica=0, idx=1, dp_idx=0, tp_idx=1))
    """

    degrees: tuple[int, ...]
    replicas: int = 1
    order: tuple[int, ...] = ()
    fold: tuple[int, ...] = ()
    """Several stages per rank: the pipeline position of every stage (its rank in a replica's
    pipeline, :class:`~gpp_deepspeed.schedule.greedy.Fold`); the stages of a position share its
    ranks and must share their degree. Blocks, ``order`` included, are then laid out per position.
    Empty: stage ``s`` is position ``s``.

    >>> p = Placement.build((1, 1, 1, 1), world_size=4, fold=(0, 1, 1, 0))
    >>> p.replicas, p.ranks(3, 1), p.stage_group(1), p.pipeline().degrees
    (2, (1,), (2, 3), (1, 1))
    """
    tp: tuple[int, ...] = ()

    @classmethod
    def build(cls, degrees, *, world_size: int, local_size: int | None = None, fold=None, tp=None,
              tp_across_nodes: bool = False) -> "Placement":
        """The placement of ``degrees`` on ``world_size`` ranks, nodes of ``local_size`` ranks,
        stages sharing positions as ``fold`` says, ``tp[s]`` of stage ``s``'s ranks in each of its
        TP groups.

        Raises a :class:`GPPConfigError` naming the numbers when the degrees do not divide the
        world (the degrees of the positions must sum to a divisor of ``world_size``), under a fold
        naming two stages of one rank whose degrees differ, when a TP degree does not divide its
        stage's degree, when a TP group would span two nodes and ``tp_across_nodes`` is not set
        (its per-layer all-reduces would cross the slow link), or for TP under a fold (not
        supported yet).
        """
        degrees = tuple(degrees)
        if not degrees or any(not isinstance(n, int) or n < 1 for n in degrees):
            raise GPPConfigError(f"stage degrees must be positive integers, one per stage, got {list(degrees)}")
        fold = tuple(fold or ())
        tp = _check_tp(degrees, tp)
        if any(t > 1 for t in tp) and fold and fold != tuple(range(len(fold))):
            raise GPPConfigError(f"tensor parallelism (stage TP degrees {list(tp)}) with several stages per rank "
                                 f"(fold {list(fold)}) is not supported yet: use one or the other")
        positions = _position_degrees(degrees, fold)
        per_replica = sum(positions)
        if world_size % per_replica:
            raise GPPConfigError(f"stage degrees {list(degrees)} need {per_replica} ranks per copy of the stage DAG, "
                                 f"which does not divide the world size ({world_size}); launch "
                                 f"{per_replica} ranks (or a multiple of {per_replica} for data-parallel replicas)")
        replicas = world_size // per_replica
        out = cls(degrees=degrees, replicas=replicas, fold=fold, tp=tp,
                  order=_pack(tuple(n * replicas for n in positions), local_size or world_size))
        if local_size and not tp_across_nodes:
            out.check_tp_in_nodes(local_size)
        return out

    def __post_init__(self):
        if self.fold and tuple(range(len(self.fold))) == self.fold:
            object.__setattr__(self, "fold", ())      # the identity fold is no fold
        if not self.order:
            object.__setattr__(self, "order", tuple(range(len(self.position_degrees))))
        if not self.tp:
            object.__setattr__(self, "tp", (1, ) * len(self.degrees))

    @property
    def dp(self) -> tuple[int, ...]:
        """Each stage's data-parallel degree in one replica: its row shards, ``degrees / tp``."""
        return tuple(n // t for n, t in zip(self.degrees, self.tp))

    @property
    def has_tp(self) -> bool:
        return any(t > 1 for t in self.tp)

    def tp_group(self, stage: int, replica: int, dp_idx: int) -> tuple[int, ...]:
        """The ranks of row shard ``dp_idx`` of ``stage`` in ``replica``, by TP rank."""
        t = self.tp[stage]
        return self.ranks(stage, replica)[dp_idx * t:(dp_idx + 1) * t]

    def shard_leaders(self, stage: int, replica: int) -> tuple[int, ...]:
        """TP rank 0 of each row shard of ``stage`` in ``replica``, by row shard: the ranks that
        send and receive the stage's activations and gradients (each then broadcasts in its TP
        group)."""
        return self.ranks(stage, replica)[::self.tp[stage]]

    def data_group(self, stage: int, tp_idx: int = 0) -> tuple[int, ...]:
        """The ranks of ``stage`` with TP rank ``tp_idx``, every row shard of every replica: its
        data-parallel group (they hold the same slice of the stage's parameters), sorted."""
        t = self.tp[stage]
        if t == 1:
            return self.stage_group(stage)
        return tuple(r for r in self.stage_group(stage) if self.locate(r).tp_idx == tp_idx % t)

    def check_tp_in_nodes(self, local_size: int) -> None:
        """Raise a :class:`GPPConfigError` naming the first TP group whose ranks span two nodes of
        ``local_size`` ranks."""
        for s in range(self.num_stages):
            for k in range(self.replicas):
                for d in range(self.dp[s]):
                    group = self.tp_group(s, k, d)
                    if group[0] // local_size != group[-1] // local_size:
                        raise GPPConfigError(
                            f"stage {s}'s tensor-parallel group {list(group)} spans two nodes of {local_size} ranks: "
                            "its per-layer all-reduces would cross the inter-node link; choose a TP degree that "
                            "divides the ranks per node (and stage degrees that keep each group in one node), or "
                            "pass tp_across_nodes=True to GraphPipelineModule to allow it")

    @property
    def num_stages(self) -> int:
        return len(self.degrees)

    @property
    def position_degrees(self) -> tuple[int, ...]:
        """The degree of every pipeline position (of every stage without a fold)."""
        return _position_degrees(self.degrees, self.fold)

    def position(self, stage: int) -> int:
        """The pipeline position that runs ``stage``."""
        return self.fold[stage] if self.fold else stage

    def stages_of(self, position: int) -> tuple[int, ...]:
        """The stages pipeline position ``position`` runs (``(position, )`` without a fold)."""
        return tuple(s for s in range(self.num_stages) if self.position(s) == position)

    def pipeline(self) -> "Placement":
        """The placement of the pipeline positions, one "stage" each: what DeepSpeed's grid sees
        (itself without a fold)."""
        if not self.fold:
            return self
        return Placement(degrees=self.position_degrees, replicas=self.replicas, order=self.order)

    @property
    def ranks_per_replica(self) -> int:
        return sum(self.position_degrees)

    @property
    def world_size(self) -> int:
        return self.replicas * self.ranks_per_replica

    def _first(self, stage: int, replica: int) -> int:
        degrees, at = self.position_degrees, self.position(stage)
        pos = self.order.index(at)
        block = self.replicas * sum(degrees[p] for p in self.order[:pos])
        return block + replica * degrees[at]

    def ranks(self, stage: int, replica: int) -> tuple[int, ...]:
        """The global ranks of ``stage`` in ``replica``, by index."""
        first = self._first(stage, replica)
        return tuple(range(first, first + self.degrees[stage]))

    def stage_group(self, stage: int) -> tuple[int, ...]:
        """Every rank of ``stage`` in every replica: its data-parallel group, sorted."""
        return tuple(sorted(r for k in range(self.replicas) for r in self.ranks(stage, k)))

    def replica_group(self, replica: int) -> tuple[int, ...]:
        """Every rank of one copy of the stage DAG, sorted."""
        return tuple(sorted({r for s in range(self.num_stages) for r in self.ranks(s, replica)}))

    def locate(self, rank: int) -> RankPlace:
        """The stage, replica and index of ``rank`` (under a fold, ask :meth:`pipeline`: a rank
        has several stages)."""
        if self.fold:
            raise GPPConfigError(f"rank {rank} holds several stages under the fold {list(self.fold)}: locate it in "
                                 "placement.pipeline()")
        if not 0 <= rank < self.world_size:
            raise GPPConfigError(f"rank {rank} is outside a placement of {self.world_size} ranks")
        pos = rank
        for s in self.order:
            size = self.replicas * self.degrees[s]
            if pos < size:
                replica, idx = divmod(pos, self.degrees[s])
                dp_idx, tp_idx = divmod(idx, self.tp[s])
                return RankPlace(s, replica, idx, dp_idx, tp_idx)
            pos -= size
        raise AssertionError("unreachable: the stage blocks cover the world")

    def check_micro_batch(self, micro_batch: int) -> None:
        """Raise a :class:`GPPConfigError` naming the first stage whose data-parallel degree does not
        divide ``micro_batch`` (every stage splits each micro-batch into equal row shards)."""
        for s, n in enumerate(self.dp):
            if micro_batch % n:
                what = f"runs on {n} ranks" if self.tp[s] == 1 else f"holds {n} row shards (TP {self.tp[s]})"
                raise GPPConfigError(f"stage {s} {what} but the micro-batch has {micro_batch} samples, "
                                     f"which do not split into {n} equal shards; make train_micro_batch_size_per_gpu "
                                     f"a multiple of every stage's data-parallel degree {list(self.dp)}")


def _check_tp(degrees: tuple[int, ...], tp) -> tuple[int, ...]:
    """``tp`` as a tuple (one per stage, default 1), checked against the stage degrees."""
    if tp is None:
        return (1, ) * len(degrees)
    tp = tuple(tp)
    if len(tp) != len(degrees) or any(not isinstance(t, int) or t < 1 for t in tp):
        raise GPPConfigError(f"stage TP degrees must be positive integers, one per stage ({len(degrees)}), got "
                             f"{list(tp)}")
    for s, (n, t) in enumerate(zip(degrees, tp)):
        if n % t:
            raise GPPConfigError(f"stage {s} runs on {n} ranks per replica, which its TP degree {t} does not divide; "
                                 f"a stage's ranks are TP degree x data-parallel degree: give stage {s} a multiple "
                                 f"of {t} ranks (stage degrees {list(degrees)}, TP degrees {list(tp)})")
    return tp


def _position_degrees(degrees: tuple[int, ...], fold: tuple[int, ...]) -> tuple[int, ...]:
    """The degree of every position of ``fold`` (its stages'; they must agree)."""
    if not fold:
        return degrees
    if len(fold) != len(degrees):
        raise GPPConfigError(f"the fold {list(fold)} places {len(fold)} stages, the degrees {list(degrees)} are of "
                             f"{len(degrees)}")
    out: dict[int, int] = {}
    for s, (p, n) in enumerate(zip(fold, degrees)):
        if out.setdefault(p, n) != n:
            other = next(t for t in range(s) if fold[t] == p)
            raise GPPConfigError(f"stages {other} and {s} share pipeline rank {p} (fold {list(fold)}) but have degrees "
                                 f"{degrees[other]} and {n}: stages sharing a rank must share its ranks, one degree")
    if sorted(out) != list(range(len(out))):
        raise GPPConfigError(f"a fold must place its stages on ranks 0..R-1, each holding one or more; got {list(fold)}")
    return tuple(out[p] for p in range(len(out)))


def _pack(sizes: tuple[int, ...], local_size: int) -> tuple[int, ...]:
    """Order stage blocks of ``sizes`` ranks so that a block that fits in a node stays in one
    (greedy, stable).

    At each position take the first stage, in stage order, that fits in what is left of the
    current node; if none does, the first one (it has to cross a node boundary anyway, or
    nothing fits and stage order is as good as any).

    >>> _pack((1, 2, 1), 2)
    (0, 2, 1)
    >>> _pack((2, 1, 1), 8)
    (0, 1, 2)
    """
    left = list(range(len(sizes)))
    order: list[int] = []
    pos = 0
    while left:
        room = local_size - pos % local_size
        pick = next((s for s in left if sizes[s] <= room), left[0])
        order.append(pick)
        left.remove(pick)
        pos += sizes[pick]
    return tuple(order)
