"""The engine's rooms: transfers without an engine, one instruction per action kind, handlers that
touch only what their kind declares, and the size of the composed engine.

The transfers run between in-process transports (no processes); the buffer check trains real gloo
ranks with a recording buffer store (tests/workers/buffer_touch.py) and compares every access with
the schedule's table, :data:`~gpp_deepspeed.schedule.KINDS`.
"""

from __future__ import annotations

import json
from collections import deque

import pytest
import torch

from conftest import WORKERS
from dist import launch
from gpp_deepspeed.engine import GraphPipelineEngine
from gpp_deepspeed.engine.buffers import StageBuffers
from gpp_deepspeed.engine.instructions import INSTRUCTION_OF, Transfers
from gpp_deepspeed.engine.p2p import EdgeTransport
from gpp_deepspeed.engine.transfers import StageTransfers
from gpp_deepspeed.graph.ir import TensorRef
from gpp_deepspeed.graph.placement import Placement
from gpp_deepspeed.graph.stages import StageEdge, StageGraph
from gpp_deepspeed.schedule import KINDS, Action, ActionKind as K, Buffer


# -- one instruction per kind -------------------------------------------------------------------

def test_every_action_kind_has_an_instruction_class_that_the_engine_dispatches():
    assert set(INSTRUCTION_OF) == set(K)
    for kind, cls in INSTRUCTION_OF.items():
        assert cls in GraphPipelineEngine._INSTRUCTION_MAP, (kind, cls)


def test_every_transfer_alone_or_grouped_is_one_transfers_instruction():
    from gpp_deepspeed.engine.instructions import to_instruction
    single = to_instruction(Action(1, K.SEND_F, 3, 2), {1: {3: 1}})
    group = to_instruction(Action.parse("(1SEND_F3@2;1RECV_B2@2)P2P"), {1: {3: 1, 2: 0}})
    assert type(single) is Transfers and single.kwargs == {"ops": ((K.SEND_F, 1, 2, 1, False), )}
    assert type(group) is Transfers and group.kwargs == {"ops": ((K.SEND_F, 1, 2, 1, False),
                                                                 (K.RECV_B, 0, 2, 1, False))}
    # A rank holding stages 1 and 3 posts both stages' transfers in one group, each in its slot.
    mixed = to_instruction(Action.parse("(1SEND_F3@2;3RECV_B3@4)P2P"), {1: {3: 1}, 3: {3: 0}})
    assert mixed.kwargs == {"ops": ((K.SEND_F, 1, 2, 1, False), (K.RECV_B, 0, 4, 3, False))}


def test_a_receive_its_list_waits_for_later_is_posted_deferred_and_its_wait_names_stage_and_slot():
    from gpp_deepspeed.engine.instructions import WaitReceives, compile_steps
    acts = [Action.parse(t) for t in "(1SEND_F0@2;1RECV_B0@2;1RECV_F1@0)P2P 1WAIT_B0 1B0 1WAIT_F1 1F1".split()]
    steps = compile_steps(acts, {1: {0: 0, 1: 1}})
    assert steps[0].instruction.kwargs == {"ops": ((K.SEND_F, 0, 2, 1, False), (K.RECV_B, 0, 2, 1, True),
                                                   (K.RECV_F, 1, 0, 1, True))}
    assert type(steps[1].instruction) is WaitReceives
    assert steps[1].instruction.kwargs == {"stage": 1, "message": "B", "buffer_id": 0}
    assert steps[3].instruction.kwargs == {"stage": 1, "message": "F", "buffer_id": 1}


def test_a_hand_over_names_both_stages_and_their_slots():
    from gpp_deepspeed.engine.instructions import HandOver, to_instruction
    hand = to_instruction(Action.parse("2HAND_F5@1"), {1: {5: 0}, 2: {5: 3}})
    assert type(hand) is HandOver
    assert hand.kwargs == {"kind": K.HAND_F, "stage": 2, "buffer_id": 3, "peer": 1, "peer_buffer_id": 0}


def test_the_composed_engine_has_at_most_45_methods_of_its_own():
    own = [name for cls in GraphPipelineEngine.__mro__ if cls.__module__.startswith("gpp_deepspeed")
           for name, value in vars(cls).items() if callable(value) and (name == "__init__" or not name.startswith("__"))]
    assert len(own) <= 45, sorted(own)


# -- transfers without an engine ----------------------------------------------------------------

class _PostOffice:
    """Messages between in-process transports: one FIFO per (sender rank, receiver rank)."""

    def __init__(self):
        self.queues: dict[tuple[int, int], deque] = {}


class _InProcessTransport(EdgeTransport):
    """EdgeTransport's layout bookkeeping with messages handed over in process, not by torch.distributed."""

    def __init__(self, post: _PostOffice, *, rank: int, stage: int):
        super().__init__(None, torch.device("cpu"), stage=stage, timeout_s=1)
        self.post, self.rank = post, rank

    def exchange(self, sends, recvs):
        for m in sends:
            self.post.queues.setdefault((self.rank, m.rank), deque()).append([b.clone() for b in m.buffers])
        for m in recvs:
            for into, got in zip(m.buffers, self.post.queues[(m.rank, self.rank)].popleft()):
                into.copy_(got)

    def wait_sends(self):
        pass


class _RecordingBuffers(StageBuffers):
    def __init__(self, num_slots):
        super().__init__(num_slots=num_slots)
        self.touched: set[Buffer] = set()

    def __getitem__(self, key):
        if isinstance(key, tuple):
            self.touched.add(key[0])
        return super().__getitem__(key)

    def __setitem__(self, key, value):
        if isinstance(key, tuple):
            self.touched.add(key[0])
        super().__setitem__(key, value)


def _rooms(degrees, tensors=("a", )):
    """Stage 0 (``degrees[0]`` ranks) sends ``tensors`` (layer ``a``'s output by default) to stage 1
    (``degrees[1]`` ranks)."""
    refs = tuple(TensorRef(t) for t in tensors)
    graph = StageGraph(num_stages=2, edges=(StageEdge(0, 1, refs), ), output_stage=1)
    placement = Placement.build(degrees, world_size=sum(degrees))
    post = _PostOffice()
    rooms = []
    for stage in (0, 1):
        for idx, rank in enumerate(placement.ranks(stage, 0)):
            transport = _InProcessTransport(post, rank=rank, stage=stage)
            rooms.append((stage, idx, StageTransfers(graph, placement, stage_idx=stage, replica=0, rank_idx=idx,
                                                     out_ports=refs, transport=transport)))
    return rooms


def _run(transfers, ops, buffers):
    buffers.touched.clear()
    transfers.run(ops, buffers)
    declared = set().union(*(KINDS[kind].touches for kind, _, _ in ops))
    assert buffers.touched <= declared, (ops, buffers.touched - declared)


@pytest.mark.parametrize("degrees", [(1, 1), (2, 1), (1, 2)], ids=lambda d: f"degrees{d}")
def test_transfers_move_each_ranks_rows_forward_and_their_gradients_back_without_an_engine(degrees):
    micro_batch = torch.arange(12.0).reshape(4, 3)
    rooms = _rooms(degrees)
    buffers = {(stage, idx): _RecordingBuffers(2) for stage, idx, _ in rooms}
    senders = [(idx, t) for stage, idx, t in rooms if stage == 0]
    receivers = [(idx, t) for stage, idx, t in rooms if stage == 1]
    rows = lambda t, idx, n: t[idx * (4 // n):(idx + 1) * (4 // n)]  # noqa: E731
    for idx, t in senders:   # slot 1 holds the micro-batch: slots are the program's, not the engine's
        buffers[0, idx][Buffer.OUTPUTS, 1] = (rows(micro_batch, idx, degrees[0]), )
        _run(t, [(K.SEND_L, 1, 1), (K.SEND_F, 1, 1)], buffers[0, idx])
    for idx, t in receivers:
        _run(t, [(K.RECV_L, 1, 0)], buffers[1, idx])
        _run(t, [(K.RECV_F, 1, 0)], buffers[1, idx])
        got = buffers[1, idx][Buffer.RECEIVED, 1][TensorRef("a")]
        assert torch.equal(got, rows(micro_batch, idx, degrees[1])) and got.requires_grad
        got.grad = -got.detach()   # as a backward leaves it
        _run(t, [(K.SEND_B, 1, 0)], buffers[1, idx])
    for idx, t in senders:
        _run(t, [(K.RECV_B, 1, 1)], buffers[0, idx])
        # Each rank differentiates its stage degree times its share (reshard.py): n_src / n_dst.
        want = -rows(micro_batch, idx, degrees[0]) * degrees[0] / degrees[1]
        assert torch.equal(buffers[0, idx][Buffer.GRADS, 1][0], want)


def test_an_edge_of_several_tensors_and_dtypes_arrives_whole_as_sent():
    # A message of one tensor goes as that tensor, one of several packed per dtype (p2p.pack);
    # what arrives is what the sender held, tuple ports, non-contiguous and integer tensors included.
    (_, _, sender), (_, _, receiver) = _rooms((1, 1), tensors=("a", "b"))
    out, rcv = _RecordingBuffers(1), _RecordingBuffers(1)
    a = torch.arange(6.0).reshape(2, 3)
    b = (torch.arange(4.0).reshape(2, 2).t(), torch.tensor([[7], [8]]))   # a tuple port: non-contiguous and int
    out[Buffer.OUTPUTS, 0] = (a, b)
    _run(sender, [(K.SEND_L, 0, 1), (K.SEND_F, 0, 1)], out)
    _run(receiver, [(K.RECV_L, 0, 0)], rcv)   # a layout arrives in an action before its activations'
    _run(receiver, [(K.RECV_F, 0, 0)], rcv)
    got = rcv[Buffer.RECEIVED, 0]
    assert torch.equal(got[TensorRef("a")], a) and all(torch.equal(x, y) for x, y in zip(got[TensorRef("b")], b))
    assert got[TensorRef("a")].requires_grad and not got[TensorRef("b")][1].requires_grad
    (_, _, sender), (_, _, receiver) = _rooms((1, 1))   # one tensor a message
    out[Buffer.OUTPUTS, 0] = (a.t(), )   # non-contiguous: sent flattened in its logical order
    _run(sender, [(K.SEND_L, 0, 1), (K.SEND_F, 0, 1)], out)
    _run(receiver, [(K.RECV_L, 0, 0)], rcv)
    _run(receiver, [(K.RECV_F, 0, 0)], rcv)
    assert torch.equal(rcv[Buffer.RECEIVED, 0][TensorRef("a")], a.t())


def test_a_receive_without_a_layout_names_the_edge_and_the_fix():
    (_, _, sender), (_, _, receiver) = _rooms((1, 1))
    buffers = _RecordingBuffers(1)
    with pytest.raises(Exception, match=r"no layout for edge 0 -> 1.*reset_activation_shape"):
        receiver.run([(K.RECV_F, 0, 0)], buffers)


# -- the engine's handlers touch what their kind declares ---------------------------------------

_TOUCH = {"steps": 2, "mbs": 2, "gas": 3, "lr": 0.1, "zero": 0, "partition": "uniform", "clip": 0}
TOUCH_CASES = {
    1: [{"id": f"one-stage-{s}", "model": "diamond", "stages": 1, "schedule": s, **_TOUCH}
        for s in ("1f1b", "zb1", "pipedream", "pipeoptim-inplace", "2bw")],
    2: [{"id": f"two-stages-{s}", "model": "diamond", "stages": 2, "schedule": s, **_TOUCH}
        for s in ("1f1b", "zb1", "pipedream", "pipeoptim")],
}


@pytest.fixture(scope="module", params=sorted(TOUCH_CASES), ids=lambda w: f"world{w}")
def touched(request, tmp_path_factory):
    world = request.param
    out = tmp_path_factory.mktemp(f"touch{world}")
    (out / "cases.json").write_text(json.dumps(TOUCH_CASES[world]))
    result = launch(world, WORKERS / "buffer_touch.py", str(out / "cases.json"), str(out), timeout=300,
                    log_dir=out / "logs")
    assert result.ok, result.report()
    return {(c["id"], r): json.loads((out / f"{c['id']}.rank{r}.json").read_text())
            for c in TOUCH_CASES[world] for r in range(world)}


def test_every_handler_touches_only_the_buffers_its_kind_declares(touched):
    seen_kinds = set()
    for (case, rank), actions in touched.items():
        assert actions, (case, rank)
        for text, buffers in actions:
            action = Action.parse(text)
            declared = set().union(*(KINDS[op.kind].touches | KINDS[op.kind].frees for op in action.parts))
            seen_kinds |= {op.kind for op in action.parts}
            undeclared = {Buffer(b) for b in buffers} - declared
            assert not undeclared, f"{case} rank {rank}: {text} touched {sorted(undeclared)} (KINDS declares " \
                                   f"{sorted(declared)})"
    # The check covered every kind that touches buffers on these programs: one stage runs no
    # transfer and, having nothing to send back, no split backward (merge_backward).
    covered = {K.LOAD, K.FORWARD, K.BACKWARD, K.RELEASE_OUT, K.RELEASE_IN, K.STASH, K.RETIRE}
    if any(case.startswith("two-stages") for case, _ in touched):
        covered |= {K.BACKWARD_INPUT, K.BACKWARD_WEIGHT, K.RELEASE_W, K.SEND_F, K.RECV_F, K.SEND_B, K.RECV_B,
                    K.SEND_L, K.RECV_L}
    assert covered <= seen_kinds, sorted(covered - seen_kinds)
