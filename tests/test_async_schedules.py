"""The asynchronous schedules as data: their action lists, the validator's weight-version rules and
the per-batch closure of messages (no process started)."""

import pytest

from gpp_deepspeed.config import parse_graph_pipeline_config
from gpp_deepspeed.errors import GPPConfigError, ScheduleError
from gpp_deepspeed.graph.stages import StageEdge, StageGraph
from gpp_deepspeed.schedule import (SCHEDULES, Action, ActionKind as K, AsyncProgram, Segment, async_compute,
                                    check_weight_versions, get_schedule, lower, simulate, steady_batch_idx,
                                    validate_async)
from gpp_deepspeed.schedule.asynchronous import prediction_steps, shift, steps_at_end
from liveness import check_slots

ASYNC_SCHEDULES = [name for name, spec in SCHEDULES.items() if spec.asynchronous]

CHAIN = StageGraph.chain(3)
# Stage 0 feeds stage 1 and, over a skip, stage 2, which merges both (a fan-in).
SKIP = StageGraph(num_stages=3, edges=(StageEdge(0, 1, ()), StageEdge(0, 2, ()), StageEdge(1, 2, ())), output_stage=2)
DIAMOND = StageGraph(num_stages=4, edges=(StageEdge(0, 1, ()), StageEdge(0, 2, ()), StageEdge(1, 3, ()),
                                          StageEdge(2, 3, ())), output_stage=3)
LONG_SKIP = StageGraph(num_stages=4, edges=(StageEdge(0, 1, ()), StageEdge(1, 2, ()), StageEdge(2, 3, ()),
                                            StageEdge(0, 3, ())), output_stage=3)
GRAPHS = {"chain": CHAIN, "skip": SKIP, "diamond": DIAMOND, "long_skip": LONG_SKIP}


def _lists(g, m, k, name, flush=False, early=True):
    """The action lists of batch ``k`` (or of the flush after ``k`` batches), as the engine runs them."""
    program = AsyncProgram(g, m, schedule=name, early=early)
    return (program.flush(k) if flush else program.batch(k)).actions


def _lowered(g, m, k, name, flush=False):
    """The same lists lowered from scratch, without the program's reuse of a steady batch."""
    rule = get_schedule(name).weights
    segment = Segment(k, m, flush)
    later = range(k + 1, k + 1 + steady_batch_idx(g, m))
    ahead = [] if flush else [async_compute(g, Segment(j, m), rule=rule) for j in later]
    return lower(async_compute(g, segment, rule=rule), g, train=True, segment=segment, ahead=ahead,
                 step=steps_at_end(segment, rule))


@pytest.mark.parametrize("graph", GRAPHS)
@pytest.mark.parametrize("name", ASYNC_SCHEDULES)
def test_async_schedule_validates_for_any_batch_count_and_micro_batches(graph, name):
    g = GRAPHS[graph]
    for m in range(1, 6):
        for n in (1, 2, 4):
            try:
                report = validate_async(g, m, schedule=name, num_batches=n)
            except GPPConfigError:
                assert name == "2bw" and m < max(g.depth(s) for s in range(g.num_stages)) - 1
                continue
            if name == "2bw":
                assert max(report.peak_versions.values()) <= 2
            elif name == "pipeoptim-inplace":   # the live weights and one copy during a forward
                assert max(report.peak_versions.values()) == 1
            else:  # one stashed version per micro-batch in flight
                assert report.peak_versions == {s: min(g.depth(s), n * m) for s in range(g.num_stages)}
            assert report.peak_in_flight == {s: min(g.depth(s), n * m) for s in range(g.num_stages)}


def test_pipedream_steady_batch_of_a_two_stage_chain_is_1f1b_without_flush():
    lists = _lists(StageGraph.chain(2), 2, 1, "pipedream", early=False)   # receives in place
    assert " ".join(map(str, lists[0])) == (
        "0STASH2 0LOAD2 0F2 (0SEND_F2@1;0RECV_B1@1)P2P 0B1 0RELEASE_OUT1 0RELEASE_IN1 0RETIRE1 0REDUCE_GRAD 0UPDATE "
        "0STASH3 0LOAD3 0F3 (0SEND_F3@1;0RECV_B2@1)P2P 0B2 0RELEASE_OUT2 0RELEASE_IN2 0RETIRE2 0REDUCE_GRAD 0UPDATE "
        "0WAIT_SENDS")
    # Stage 1 ran B1 in batch 0 but stage 0 receives it in batch 1: the send opens batch 1.
    assert " ".join(map(str, lists[1])) == (
        "1SEND_B1@0 1RELEASE_IN1 1STASH2 1LOAD2 1RECV_F2@0 1F2 1B2 1RELEASE_OUT2 1SEND_B2@0 1RELEASE_IN2 "
        "1RETIRE2 1REDUCE_GRAD 1UPDATE 1STASH3 1LOAD3 1RECV_F3@0 1F3 1B3 1RELEASE_OUT3 1RETIRE3 1REDUCE_GRAD 1UPDATE "
        "1WAIT_SENDS")


def test_a_gradient_is_sent_in_the_batch_where_its_receiver_runs_the_backward():
    # Stage 2 (lag 0) runs B0 and B1 in batch 0; stage 1 (lag 1) runs B1, and stage 0 (lag 2) B0 and
    # B1, in batch 1: those sends open batch 1.
    b0, b1 = _lists(SKIP, 2, 0, "pipedream"), _lists(SKIP, 2, 1, "pipedream")
    sends = lambda seg: {op for a in seg[2] for op in a.transfers if op.kind is K.SEND_B}  # noqa: E731
    assert sends(b0) == {Action(2, K.SEND_B, 0, peer=1)}
    assert {Action(2, K.SEND_B, 0, peer=0), Action(2, K.SEND_B, 1, peer=0), Action(2, K.SEND_B, 1, peer=1)} <= sends(b1)
    for seg in (b0, b1, _lists(SKIP, 2, 2, "pipedream", flush=True)):
        simulate(seg, mode="rendezvous")  # each batch closes, even when a send waits for its receive


def test_steady_batches_repeat_shifted_by_the_batch_size():
    k = steady_batch_idx(LONG_SKIP, 2)
    a, b = _lowered(LONG_SKIP, 2, k, "2bw"), _lowered(LONG_SKIP, 2, k + 1, "2bw")
    def moved(x):
        if x.kind is K.P2P:
            return Action.group(moved(op) for op in x.ops)
        return Action(x.stage_idx, x.kind, None if x.mb_idx is None else x.mb_idx + 2, x.peer)
    shift = {s: [moved(x) for x in a[s]] for s in a}
    assert shift == b


@pytest.mark.parametrize("name", ASYNC_SCHEDULES)
def test_the_engine_may_reuse_the_steady_batch_and_flush_shifted(name):
    for g in GRAPHS.values():
        for m in (3, 4):
            k = steady_batch_idx(g, m)
            for flush in (False, True):
                a, b = _lowered(g, m, k, name, flush), _lowered(g, m, k + 2, name, flush)
                assert {s: shift(x, 2 * m) for s, x in a.items()} == b
                assert _lists(g, m, k + 2, name, flush) == b


def test_2bw_updates_with_the_previous_batch_in_a_synchronous_step_at_the_end_of_each_batch():
    # Batch 1 runs on W(0) (stashed before any update); its end retires batch 0's version and steps
    # as a synchronous batch does, on every stage, so batch 2's stash takes W(1).
    weights = (K.STASH, K.RETIRE, K.FORWARD, K.REDUCE_TIED, K.REDUCE_GRAD, K.STEP)
    for k in (1, 2):
        lists = _lists(CHAIN, 3, k, "2bw")
        for s, actions in lists.items():
            kept = [a for a in actions if a.kind in weights]
            assert kept == [Action(s, K.STASH, 3 * k), *(Action(s, K.FORWARD, j) for j in range(3 * k, 3 * k + 3)),
                            Action(s, K.RETIRE, 3 * k - 3), Action(s, K.REDUCE_TIED), Action(s, K.REDUCE_GRAD),
                            Action(s, K.STEP)]
    assert not any(a.kind in (K.RETIRE, K.STEP) for actions in _lists(CHAIN, 3, 0, "2bw").values() for a in actions)
    assert [a for a in _lists(CHAIN, 3, 2, "2bw", flush=True)[2] if a.kind in weights] == [
        Action(2, K.RETIRE, 3), Action(2, K.REDUCE_TIED), Action(2, K.REDUCE_GRAD), Action(2, K.STEP)]


def test_frozen_stages_run_forwards_on_their_live_weights_and_take_no_update_of_their_own():
    from dataclasses import replace
    frozen = replace(SKIP, frozen=frozenset({0}), edges=tuple(replace(e, grad=e.src != 0) for e in SKIP.edges))
    for name in ASYNC_SCHEDULES:
        report = validate_async(frozen, 3, schedule=name)
        assert report.peak_versions[0] == 0, name
        for k in range(3):
            kinds = {a.kind for a in _lists(frozen, 3, k, name)[0]}
            assert kinds.isdisjoint({K.BACKWARD, K.STASH, K.PREDICT, K.RETIRE, K.UPDATE, K.RECV_B}), (name, k)
            # 2BW's step is collective over the pipeline: the frozen stage takes part.
            assert (K.STEP in kinds) == (name == "2bw" and k > 0), (name, k)


def test_2bw_needs_as_many_micro_batches_as_the_deepest_lag():
    with pytest.raises(GPPConfigError, match="gradient_accumulation_steps >= 3"):
        validate_async(LONG_SKIP, 2, schedule="2bw")


def test_validator_rejects_a_retire_before_the_backward_of_its_version():
    program = [Action.parse(x) for x in "0STASH0 0F0 0RETIRE0 0UPDATE 0B0".split()]
    with pytest.raises(ScheduleError, match="before the backwards of micro-batches"):
        check_weight_versions(0, program)


def test_validator_rejects_a_forward_on_no_version_and_a_version_never_retired():
    with pytest.raises(ScheduleError, match="on no live weight version"):
        check_weight_versions(0, [Action.parse("0F0")])
    with pytest.raises(ScheduleError, match="never retires weight versions"):
        check_weight_versions(0, [Action.parse(x) for x in "0STASH0 0F0 0B0".split()])


def test_validator_rejects_two_retired_gradients_without_an_update_between():
    program = [Action.parse(x) for x in "0STASH0 0F0 0STASH1 0F1 0B0 0RETIRE0 0B1 0RETIRE1 0UPDATE".split()]
    with pytest.raises(ScheduleError, match="before an update used the gradient of version 0"):
        check_weight_versions(0, program)


def test_validator_rejects_a_backward_while_the_live_weights_hold_a_prediction():
    program = [Action.parse(x) for x in "0PREDICT_INPLACE0 0F0 0B0 0RESTORE0".split()]
    with pytest.raises(ScheduleError, match="before restoring the live weights"):
        check_weight_versions(0, program)
    ok = [Action.parse(x) for x in "0PREDICT_INPLACE0 0F0 0RESTORE0 0B0 0RETIRE0 0REDUCE_GRAD 0UPDATE".split()]
    assert check_weight_versions(0, ok) == 1   # the copy of the live weights, until RESTORE


def test_dropping_a_deferred_send_is_a_deadlock_the_simulator_names():
    lists = _lists(SKIP, 2, 1, "pipedream")
    gone = Action(2, K.SEND_B, 0, peer=0)

    def drop(a):
        if a.kind is not K.P2P:
            return a
        ops = [op for op in a.ops if op != gone]
        return ops[0] if len(ops) == 1 else Action.group(ops)
    lists[2] = [drop(a) for a in lists[2] if a != gone]
    assert all(gone not in a.transfers for a in lists[2])
    with pytest.raises(ScheduleError, match="deadlock|carries micro-batch"):
        simulate(lists)


@pytest.mark.parametrize("name", ["pipeoptim", "pipeoptim-inplace"])
def test_pipeoptim_predicts_over_the_updates_between_forward_and_backward(name):
    program = [a for k in range(3) for a in _lists(CHAIN, 2, k, name)[0]]
    program += _lists(CHAIN, 2, 3, name, flush=True)[0]
    assert prediction_steps(program) == {0: 0, 1: 1, 2: 2, 3: 2, 4: 2, 5: 2}


def test_pipeoptim_inplace_holds_one_copy_of_the_weights_and_restores_them_after_each_forward():
    report = validate_async(CHAIN, 3, schedule="pipeoptim-inplace")
    assert report.peak_versions == {0: 1, 1: 1, 2: 1}
    assert validate_async(CHAIN, 3, schedule="pipeoptim").peak_versions == {0: 3, 1: 2, 2: 1}
    lists = _lists(CHAIN, 2, 1, "pipeoptim-inplace")[0]
    kinds = [a.kind for a in lists if a.kind in (K.PREDICT_INPLACE, K.FORWARD, K.RESTORE)]
    assert kinds == [K.PREDICT_INPLACE, K.FORWARD, K.RESTORE] * 2


def test_weight_actions_round_trip_through_their_string_form():
    for name in ASYNC_SCHEDULES:
        for actions in _lists(SKIP, 3, 1, name).values():
            assert [Action.parse(str(a)) for a in actions] == actions


def test_config_accepts_the_asynchronous_schedules():
    for name in ASYNC_SCHEDULES:
        assert parse_graph_pipeline_config({"graph_pipeline": {"schedule": name}}).schedule == name


@pytest.mark.parametrize("name", ASYNC_SCHEDULES)
def test_buffer_slots_are_those_of_assign_buffers_over_the_whole_never_draining_program(name):
    from gpp_deepspeed.schedule import assign_buffers
    for g in GRAPHS.values():
        for m in (1, 2, 3, 5):
            try:
                program = AsyncProgram(g, m, schedule=name)
            except GPPConfigError:
                continue
            n = 3 * max(program.periods.values()) + program.first_periodic[0] + 2
            segments = [program.batch(k) for k in range(n)] + [program.flush(n)]
            whole = {s: [a for seg in segments for a in seg.actions[s]] for s in range(g.num_stages)}
            reference = assign_buffers(whole)   # one pass over the program as if it were one batch
            slots = {s: {} for s in range(g.num_stages)}
            for s in range(g.num_stages):
                for seg in segments:
                    for j, slot in seg.slots[s].items():
                        assert slots[s].setdefault(j, slot) == slot, f"micro-batch {j} keeps its slot on stage {s}"
                assert slots[s] == reference[s], (m, s)
                assert program.num_buffers(s) == max(reference[s].values()) + 1
            check_slots(whole, slots)   # and against live ranges read from the program's text


def test_the_validator_rejects_a_micro_batch_that_changes_slot_between_batches():
    from dataclasses import replace
    program = AsyncProgram(CHAIN, 2, schedule="pipedream")
    program.validate()
    first = program.batch(1)
    moved = {s: dict(slot_of) for s, slot_of in first.slots.items()}
    j = min(moved[0])   # a micro-batch of batch 0 still held in batch 1 on stage 0 (lag 2)
    moved[0][j] += 7
    program._batches[1] = replace(first, slots=moved)
    with pytest.raises(ScheduleError, match=f"micro-batch {j} moves from buffer slot"):
        program.validate()


def test_the_validator_checks_the_prediction_counts_the_program_carries():
    from dataclasses import replace
    program = AsyncProgram(CHAIN, 2, schedule="pipeoptim")
    program.validate()
    second = program.batch(1)
    assert second.predictions[0] == {2: 2, 3: 2} and second.predictions[2] == {2: 0, 3: 0}
    wrong = {s: dict(p) for s, p in second.predictions.items()}
    wrong[0][3] = 1
    program._batches[1] = replace(second, predictions=wrong)
    with pytest.raises(ScheduleError, match="stage 0: version 3 meets 2 updates before its backward, but the program "
                                            "predicts over 1"):
        program.validate()


def test_the_program_factory_sends_layouts_in_every_asynchronous_batch_and_keeps_the_pipeline_shape():
    from gpp_deepspeed.schedule import ProgramFactory
    programs = ProgramFactory(CHAIN, schedule="pipedream", validate=True)
    assert all(programs.program(2, batch_idx=k).layouts for k in range(3))
    assert programs.program(2, batch_idx=3, flush=True).layouts
    assert programs.program(2).segment.batch_idx == steady_batch_idx(CHAIN, 2)   # the simulator's batch
    assert not programs.program(2, train=False).layouts
    with pytest.raises(GPPConfigError, match="changed from 2 to 3 while the pipeline is full"):
        programs.program(3, batch_idx=1)
    assert programs.program(3, batch_idx=0).num_microbatches == 3   # an empty pipeline takes any size
    one_f_one_b = ProgramFactory(CHAIN, schedule="1f1b")
    assert one_f_one_b.program(2, layouts=True).layouts and not one_f_one_b.program(2).layouts
    assert one_f_one_b.program(2) is one_f_one_b.program(2, batch_idx=5)   # one program per shape
