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
    """Where one rank sits: its stage, its replica of the stage DAG and its index in the stage."""

    stage: int
    replica: int
    idx: int


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
    (2, (0, 1), (2, 3), (5,), RankPlace(stage=1, replica=1, idx=0))
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

    @classmethod
    def build(cls, degrees, *, world_size: int, local_size: int | None = None, fold=None) -> "Placement":
        """The placement of ``degrees`` on ``world_size`` ranks, nodes of ``local_size`` ranks,
        stages sharing positions as ``fold`` says.

        Raises a :class:`GPPConfigError` naming the numbers when the degrees do not divide the
        world (the degrees of the positions must sum to a divisor of ``world_size``), or, under a
        fold, naming two stages of one rank whose degrees differ.
        """
        degrees = tuple(degrees)
        if not degrees or any(not isinstance(n, int) or n < 1 for n in degrees):
            raise GPPConfigError(f"stage degrees must be positive integers, one per stage, got {list(degrees)}")
        fold = tuple(fold or ())
        positions = _position_degrees(degrees, fold)
        per_replica = sum(positions)
        if world_size % per_replica:
            raise GPPConfigError(f"stage degrees {list(degrees)} need {per_replica} ranks per copy of the stage DAG, "
                                 f"which does not divide the world size ({world_size}); launch "
                                 f"{per_replica} ranks (or a multiple of {per_replica} for data-parallel replicas)")
        replicas = world_size // per_replica
        return cls(degrees=degrees, replicas=replicas, fold=fold,
                   order=_pack(tuple(n * replicas for n in positions), local_size or world_size))

    def __post_init__(self):
        if self.fold and tuple(range(len(self.fold))) == self.fold:
            object.__setattr__(self, "fold", ())      # the identity fold is no fold
        if not self.order:
            object.__setattr__(self, "order", tuple(range(len(self.position_degrees))))

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
                return RankPlace(s, replica, idx)
            pos -= size
        raise AssertionError("unreachable: the stage blocks cover the world")

    def check_micro_batch(self, micro_batch: int) -> None:
        """Raise a :class:`GPPConfigError` naming the first stage whose degree does not divide
        ``micro_batch`` (every stage splits each micro-batch into equal row shards)."""
        for s, n in enumerate(self.degrees):
            if micro_batch % n:
                raise GPPConfigError(f"stage {s} runs on {n} ranks but the micro-batch has {micro_batch} samples, "
                                     f"which do not split into {n} equal shards; make train_micro_batch_size_per_gpu "
                                     f"a multiple of every stage degree {list(self.degrees)}")


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
