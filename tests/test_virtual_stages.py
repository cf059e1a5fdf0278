"""Several stages per rank, the schedule side (gpp_deepspeed.schedule.virtual): folds, and the
compute order of each rank, against 1F1B and a replay of the orders (pure Python, no processes)."""

from __future__ import annotations

import random

import pytest

from gpp_deepspeed.errors import GPPConfigError, ScheduleError
from gpp_deepspeed.schedule.virtual import Fold, fold_in_flight, interleaved_1f1b, rank_in_flight, rank_makespan, rank_orders
from gpp_deepspeed.graph import StageGraph
from gpp_deepspeed.graph.stages import StageEdge
from gpp_deepspeed.schedule import Action, ActionKind as K, one_f_one_b

FULL = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
HALF = {k: v / 2 for k, v in FULL.items()}   # a stage of half the layers


def priced(table):
    return lambda a: table.get(a.kind.value, 0.0)


def test_a_fold_must_use_every_rank_from_zero():
    with pytest.raises(ScheduleError, match="ranks 0..R-1"):
        Fold((0, 2))
    with pytest.raises(ScheduleError, match="do not pair up"):
        Fold.v_shape(num_stages=5)


@pytest.mark.parametrize("num_stages", [2, 4, 6])
def test_one_stage_per_rank_with_a_fused_backward_is_1f1b(num_stages):
    graph = StageGraph.chain(num_stages)
    orders = rank_orders(graph, 8, Fold(tuple(range(num_stages))), split_backward=False, duration=priced(FULL))
    assert orders == one_f_one_b(graph, 8)


def _random_dag(rng, num_stages):
    edges = {(s, s + 1) for s in range(num_stages - 1) if rng.random() < 0.6}
    edges |= {(s, t) for s in range(num_stages) for t in range(s + 2, num_stages) if rng.random() < 0.25}
    for s in range(num_stages - 1):       # every stage reaches the output (the last one)
        if not any(a == s for a, _ in edges):
            edges.add((s, num_stages - 1))
    return StageGraph(num_stages=num_stages, edges=tuple(StageEdge(s, t, ()) for s, t in sorted(edges)),
                      output_stage=num_stages - 1)


@pytest.mark.parametrize("seed", range(12))
def test_rank_orders_of_random_folds_of_random_dags_run_every_action_once_without_deadlock(seed):
    rng = random.Random(seed)
    num_stages = rng.randint(2, 7)
    graph = _random_dag(rng, num_stages)
    num_ranks = rng.randint(1, num_stages)
    rank_of = [rng.randrange(num_ranks) for _ in range(num_stages)]
    rank_of[:num_ranks] = range(num_ranks)   # every rank holds a stage
    fold, split, num_mb = Fold(tuple(rank_of)), bool(seed % 2), rng.randint(1, 6)
    kinds = ("F", "I", "W") if split else ("F", "B")
    for by_microbatch in (False, True):   # Megatron's rule and ZB-V's
        orders = rank_orders(graph, num_mb, fold, split_backward=split, by_microbatch=by_microbatch)
        for s in range(num_stages):
            ran = [str(a) for a in orders[fold.rank_of[s]] if a.stage_idx == s]
            assert sorted(ran) == sorted(f"{s}{k}{j}" for k in kinds for j in range(num_mb))
        assert rank_makespan(orders, graph) > 0   # the replay raises on a deadlock


def test_v_placement_with_a_split_backward_beats_1f1b_on_the_same_layers():
    # ZB-V (arXiv 2405.15362): 4 ranks, each an early and a late half of a chain of 8 half-stages,
    # against 1F1B on 4 whole stages; 16 micro-batches, T_F = T_I = T_W.
    halves, whole = StageGraph.chain(8), StageGraph.chain(4)
    zbv = rank_orders(halves, 16, Fold.v_shape(num_stages=8), split_backward=True, duration=priced(HALF),
                      by_microbatch=True)
    ideal = 16 * 3.0
    v_time = rank_makespan(zbv, halves, priced(HALF))
    f1b = one_f_one_b(whole, 16)
    f1b_time = rank_makespan(f1b, whole, priced(FULL))
    assert ideal <= v_time < 0.95 * f1b_time and f1b_time == ideal + 3 * 3.0
    # ... at 1F1B's activation memory: no rank holds more whole-layer micro-batches than 1F1B's first.
    assert max(_peak_layers(zbv[r], 2) for r in zbv) <= _peak_layers(f1b[0], 1) == 4


@pytest.mark.parametrize("num_ranks, num_mb", [(1, 3), (2, 2), (2, 4), (3, 5), (4, 8), (4, 16), (8, 7), (8, 16), (8, 32)])
def test_zbv_on_a_v_over_a_chain_runs_torchs_zbv_order_action_for_action_unless_the_greedy_is_shorter(num_ranks,
                                                                                                      num_mb):
    # torch's own ZB-V generator (ScheduleZBVZeroBubble, Qi et al.'s schedule) is the reference.
    import types

    from torch.distributed.pipelining import schedules as torch_schedules

    from gpp_deepspeed.schedule.virtual import FOLDED_SCHEDULES, zbv_v_order

    p, chain, fold = num_ranks, StageGraph.chain(2 * num_ranks), Fold.v_shape(num_stages=2 * num_ranks)
    kind = {"FORWARD": K.FORWARD, "BACKWARD_INPUT": K.BACKWARD_INPUT, "BACKWARD_WEIGHT": K.BACKWARD_WEIGHT}
    this = types.SimpleNamespace(pp_group_size=p, _n_microbatches=num_mb, num_stages=2 * p, n_local_stages=2,
                                 stage_index_to_group_rank=dict(enumerate(fold.rank_of)))
    torch_orders = {r: [Action(a.stage_index, kind[a.computation_type.name], a.microbatch_index) for a in
                        torch_schedules.ScheduleZBVZeroBubble._calculate_single_rank_operations(this, r) if a]
                    for r in range(p)}
    assert zbv_v_order(p, num_mb) == torch_orders
    greedy = rank_orders(chain, num_mb, fold, split_backward=True, by_microbatch=True)
    ours = FOLDED_SCHEDULES["zbv"][1](chain, num_mb, fold)
    # With at least 2p - 1 micro-batches ZB-V's order is as short as the greedy one (two
    # forwards shorter at 8 ranks) and zbv runs it; with fewer the greedy one is shorter.
    shorter = rank_makespan(torch_orders, chain) <= rank_makespan(greedy, chain)
    assert shorter == (num_mb >= 2 * p - 1) and ours == (torch_orders if shorter else greedy)
    assert max(_peak_layers(torch_orders[r], 1) for r in torch_orders) <= 2 * p
    # Megatron's rule (groups of p micro-batches, each reserving its stages on a rank) is longer.
    if num_mb >= 2 * p and p > 1:
        megatron = rank_orders(chain, num_mb, fold, split_backward=True, max_in_flight={r: 2 * p for r in range(p)})
        assert rank_makespan(megatron, chain) > rank_makespan(ours, chain)


def _peak_layers(actions, stages_per_layer):
    """Most micro-batches of one whole layer's activations held at once (F run, B or W not yet)."""
    live = peak = 0
    for a in actions:
        live += a.kind is K.FORWARD
        live -= a.kind in (K.BACKWARD, K.BACKWARD_WEIGHT)
        peak = max(peak, live)
    return peak / stages_per_layer


def test_the_in_flight_bound_of_a_rank_is_1f1b_with_one_stage_megatrons_when_looped_and_zbvs_in_a_v():
    chain = StageGraph.chain(8)
    assert [rank_in_flight(chain, Fold(tuple(range(8))), r) for r in range(8)] == [8 - r for r in range(8)]
    p = 4
    assert [rank_in_flight(chain, Fold.looped(num_stages=8, num_ranks=p), r) for r in range(p)] == \
        [2 * (p - r - 1) + p + 1 for r in range(p)]
    assert {rank_in_flight(chain, Fold.v_shape(num_stages=8), r) for r in range(p)} == {2 * p}


def _four_branches_in_halves() -> StageGraph:
    """benchmarks/peers.py's four branches (3, 1, 1, 1 layers into a trunk of 2), each layer two
    half-layer stages, the second half what the layer's successors read: 16 stages."""
    layers = [("b0_0", []), ("b0_1", ["b0_0"]), ("b0_2", ["b0_1"]), ("b1_0", []), ("b2_0", []), ("b3_0", []),
              ("t0", ["b0_2", "b1_0", "b2_0", "b3_0"]), ("t1", ["t0"])]
    second, edges = {}, []
    for name, inputs in layers:
        first = 2 * len(second)
        second[name] = first + 1
        edges += [StageEdge(second[x], first, ()) for x in inputs] + [StageEdge(first, first + 1, ())]
    return StageGraph(num_stages=16, edges=tuple(edges), output_stage=15)


def test_zbv_lets_every_rank_hold_what_the_folds_fullest_rank_may_and_so_fills_a_dags_gaps():
    # The fold the fold search picks for peers.py's four branches, priced with its sleeps (10 ms
    # per half-layer action; a branch's first layer has no input gradient).
    from gpp_deepspeed.schedule.virtual import FOLDED_SCHEDULES

    graph = _four_branches_in_halves()
    fold = Fold((0, 1, 2, 3, 4, 0, 5, 6, 7, 4, 2, 3, 1, 7, 5, 6))
    sources = {0, 1, 6, 7, 8, 9, 10, 11}
    source_table = {**HALF, "I": 0.0, "B": HALF["W"]}   # a branch's first layer takes no input gradient
    sleeps = lambda a: priced(source_table if a.stage_idx in sources else HALF)(a)  # noqa: E731
    bounds = {r: rank_in_flight(graph, fold, r) for r in range(8)}
    zbv = FOLDED_SCHEDULES["zbv"][1](graph, 16, fold, duration=sleeps)
    own = rank_orders(graph, 16, fold, split_backward=True, duration=sleeps, by_microbatch=True)   # own bounds
    assert len(set(bounds.values())) > 1
    assert max(_peak_layers(zbv[r], 1) for r in zbv) <= max(bounds.values())
    assert rank_makespan(zbv, graph, sleeps) < rank_makespan(own, graph, sleeps)
    # A V over a chain gives every rank ZB-V's 2p already: the shared cap is each rank's own.
    chain, v = StageGraph.chain(8), Fold.v_shape(num_stages=8)
    assert fold_in_flight(chain, v) == {r: rank_in_flight(chain, v, r) for r in range(4)}
    # ... and a cap given by hand is the cap: fewer micro-batches held, a longer step.
    capped = FOLDED_SCHEDULES["zbv"][1](graph, 16, fold, duration=sleeps, max_in_flight=4)
    assert max(_peak_layers(capped[r], 1) for r in capped) <= 4
    assert rank_makespan(capped, graph, sleeps) > rank_makespan(zbv, graph, sleeps)


@pytest.mark.parametrize("schedule,fold,cap,message", [
    ("dualpipev", "v", 4, 'schedule "dualpipev" runs an order that max_in_flight does not shape'),
    ("interleaved", None, [4, 4], 'schedule "interleaved" runs an order that max_in_flight does not shape'),
    ("1f1b", None, 4, 'schedule "1f1b" runs an order that max_in_flight does not shape'),
    ("zbv", "v", [4, 4, 4], "one for each of the 4 pipeline ranks; got \\[4, 4, 4\\]"),
    ("zbv", "v", 0, "a positive int"),
    ("zbv", "v", 1, "rank 0 may hold 1 micro-batch\\(es\\) in flight, but a micro-batch passes 2 of its stages "
                    "\\[0, 7\\]"),
])
def test_a_cap_of_micro_batches_in_flight_is_refused_by_name_where_it_cannot_hold(schedule, fold, cap, message):
    from gpp_deepspeed.errors import GPPConfigError
    from gpp_deepspeed.schedule import ProgramFactory, build_program

    chain = StageGraph.chain(8)
    fold = Fold.v_shape(num_stages=8) if fold == "v" else None
    with pytest.raises(GPPConfigError, match=message):
        build_program(chain, 8, schedule=schedule, fold=fold, max_in_flight=cap)
    if cap != 1:   # what needs the order to show is found when the order is made
        with pytest.raises(GPPConfigError, match=message):   # the engine's factory: at construction, on every rank
            ProgramFactory(chain, schedule=schedule, fold=fold, max_in_flight=cap)


def test_the_config_takes_one_cap_for_every_rank_or_one_per_rank_and_a_plan_only_with_a_fold():
    from gpp_deepspeed.config import parse_graph_pipeline_config
    from gpp_deepspeed.errors import GPPConfigError
    from gpp_deepspeed.planner import Plan, PlanStage

    config = lambda cap: parse_graph_pipeline_config({"graph_pipeline": {"schedule": "zbv", "max_in_flight": cap}})  # noqa: E731
    assert config(6).max_in_flight == 6 and config([6, 5]).max_in_flight == [6, 5]
    with pytest.raises(GPPConfigError, match="max_in_flight"):
        config(0)
    stages = tuple(PlanStage(layers=(n, )) for n in "abcd")
    plan = dict(model="m", method="fold", source="hand", micro_batch=1, mini_batch=8, stages=stages, schedule="zbv")
    folded = Plan(**plan, fold=(0, 1, 1, 0), max_in_flight=(3, 2))
    assert Plan.from_json(folded.to_json()) == folded
    with pytest.raises(GPPConfigError, match="the plan has no fold"):
        Plan(**plan, max_in_flight=(3, 2))
    with pytest.raises(GPPConfigError, match="one for each of the 2 pipeline ranks"):
        Plan(**plan, fold=(0, 1, 1, 0), max_in_flight=(3, 2, 1))


@pytest.mark.parametrize("p", [2, 4])
def test_interleaved_1f1b_on_a_looped_chain_has_megatrons_bubble(p):
    # Narayanan et al., SC'21, Sec. 2.2: v chunks per rank cut 1F1B's bubble (p - 1)(t_f + t_b) by v.
    chain, m = StageGraph.chain(2 * p), 16
    orders = interleaved_1f1b(chain, m, Fold.looped(num_stages=2 * p, num_ranks=p))
    assert rank_makespan(orders, chain, priced(HALF)) == m * 3.0 + (p - 1) * 3.0 / 2


@pytest.mark.parametrize("seed", range(8))
def test_interleaved_1f1b_on_random_dags_never_deadlocks(seed):
    rng = random.Random(seed)
    graph = _random_dag(rng, rng.randint(3, 7))
    fold = Fold.looped(num_stages=graph.num_stages, num_ranks=rng.randint(1, graph.num_stages - 1))
    orders = interleaved_1f1b(graph, rng.randint(2, 8), fold)
    assert rank_makespan(orders, graph) > 0


@pytest.mark.parametrize("seed", range(16))
def test_folded_programs_of_random_dags_run_under_nccl_semantics_and_take_their_compute_makespan(seed):
    # fold_program raises unless the rendezvous simulation (NCCL's semantics) completes; with free
    # messages the lowered program takes exactly what its compute order takes on the replay.
    from gpp_deepspeed.schedule.virtual import fold_program
    from gpp_deepspeed.schedule.validate import simulate

    rng = random.Random(seed)
    graph = _random_dag(rng, rng.randint(2, 7))
    num_ranks = rng.randint(1, graph.num_stages)
    rank_of = [rng.randrange(num_ranks) for _ in range(graph.num_stages)]
    rank_of[:num_ranks] = range(num_ranks)
    fold, num_mb = Fold(tuple(rank_of)), rng.randint(1, 6)
    orders = rank_orders(graph, num_mb, fold, split_backward=False)
    program = fold_program(graph, num_mb, fold, orders)
    for r, actions in program.items():
        ops = [op for a in actions for op in a.parts]
        assert all(fold.rank_of[op.stage_idx] == r for op in ops)
        # an edge inside the rank is a hand-over: no message on it
        assert not [op for op in ops if op.kind.has_peer and fold.rank_of[op.peer] == r]
        assert sum(op.kind is K.STEP for op in ops) == 1
    timeline = simulate(program, duration=priced(FULL))
    end = max(e for spans in timeline.spans.values() for _, _, e in spans)
    assert end == rank_makespan(orders, graph, priced(FULL))


def test_a_folded_program_with_a_hand_over_out_of_order_or_a_release_missing_is_refused():
    from gpp_deepspeed.schedule.virtual import fold_program, validate_folded

    chain, fold = StageGraph.chain(4), Fold.v_shape(num_stages=4)   # rank 1 holds stages 1 and 2
    program = fold_program(chain, 2, fold, rank_orders(chain, 2, fold, split_backward=False))
    validate_folded(program, chain, 2, fold)
    rank1 = program[1]
    first, second = (rank1.index(next(a for a in rank1 if str(a) == t)) for t in ("1F0", "2F0"))
    swapped = list(rank1)
    swapped[first], swapped[second] = swapped[second], swapped[first]
    with pytest.raises(ScheduleError, match=r"2HAND_F0@1 must run after 1F0 and before 2F0"):
        validate_folded({**program, 1: swapped}, chain, 2, fold)
    for hand in ("2HAND_F0@1", "1HAND_B1@2"):      # each hand-over is an action the program must hold
        with pytest.raises(ScheduleError, match="never takes"):
            validate_folded({**program, 1: [a for a in rank1 if str(a) != hand]}, chain, 2, fold)
    b = rank1.index(next(a for a in rank1 if str(a) == "1HAND_B0@2"))
    late = [a for i, a in enumerate(rank1) if i != b]
    late.insert(len(late) - 4, rank1[b])           # after stage 1's backward of micro-batch 0
    with pytest.raises(ScheduleError, match=r"1HAND_B0@2"):
        validate_folded({**program, 1: late}, chain, 2, fold)
    without = [a for a in rank1 if str(a) != "2RELEASE_IN0"]
    with pytest.raises(ScheduleError, match="2RELEASE_IN0"):
        validate_folded({**program, 1: without}, chain, 2, fold)


@pytest.mark.parametrize("seed", range(6))
def test_the_fold_search_finds_what_a_brute_force_over_every_map_of_stages_to_ranks_finds(seed):
    import itertools

    from gpp_deepspeed.planner.fold_search import search_fold
    from gpp_deepspeed.schedule.virtual import dualpipev_orders, interleaved_1f1b

    rng = random.Random(seed)
    graph = _random_dag(rng, rng.randint(3, 6)) if seed else StageGraph.chain(6)
    num_ranks = rng.randint((graph.num_stages + 1) // 2, graph.num_stages - 1) if seed else 3
    work = {s: rng.choice([0.5, 1.0, 1.5]) for s in range(graph.num_stages)}
    unit = lambda a: work[a.stage_idx] * {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}.get(a.kind.value, 0.0)  # noqa: E731
    activation = {s: rng.choice([1.0, 2.0]) for s in range(graph.num_stages)}
    weights = {s: rng.choice([0.0, 1.0]) for s in range(graph.num_stages)}
    memory = 12.0
    found = search_fold(graph, 6, num_ranks=num_ranks, duration=unit, activation=activation, memory=memory,
                        static=weights)

    def peak(actions):
        live = best = 0.0
        for a in actions:
            live += activation[a.stage_idx] * (a.kind is K.FORWARD)
            live -= activation[a.stage_idx] * (a.kind in (K.BACKWARD, K.BACKWARD_WEIGHT))
            best = max(best, live)
        return best

    best = None
    for rank_of in itertools.product(range(num_ranks), repeat=graph.num_stages):
        if set(rank_of) != set(range(num_ranks)) or max(rank_of.count(r) for r in range(num_ranks)) > 2:
            continue
        fold = Fold(rank_of)
        # zbv at its own caps (every rank the fold's largest bound) and at each rank's own bound.
        own = {r: rank_in_flight(graph, fold, r) for r in range(num_ranks)}
        candidates = [interleaved_1f1b(graph, 6, fold),
                      rank_orders(graph, 6, fold, split_backward=True, duration=unit, by_microbatch=True),
                      rank_orders(graph, 6, fold, split_backward=True, duration=unit, by_microbatch=True,
                                  max_in_flight={r: max(own.values()) for r in own})]
        # ... and at every smaller cap, the same on every rank (fewer in flight, less memory).
        for cap in range(1, max(own.values())):
            try:
                candidates.append(rank_orders(graph, 6, fold, split_backward=True, duration=unit, by_microbatch=True,
                                              max_in_flight={r: cap for r in own}))
            except GPPConfigError:   # below what a micro-batch passing several of a rank's stages needs
                pass
        if all(rank_of.count(r) == 2 for r in range(num_ranks)) and 6 >= 2 * num_ranks - 1:
            candidates.append(dualpipev_orders(graph, 6, fold))
        for orders in candidates:
            held = [peak(orders[r]) + sum(weights[s] for s in fold.stages_of(r)) for r in orders]
            if max(held) <= memory:
                time = rank_makespan(orders, graph, unit)
                best = time if best is None else min(best, time)
    assert found.makespan == best and max(found.peak) <= memory


def _torch_dualpipev(num_ranks, num_mb):
    """torch 2.13's ScheduleDualPipeV order per rank (FULL_BACKWARD as B, an overlapped F&B pair as
    its forward then its backward), from its own generator."""
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import ScheduleDualPipeV, _ComputationType as C

    kinds = {C.FORWARD: "F", C.FULL_BACKWARD: "B", C.BACKWARD_INPUT: "I", C.BACKWARD_WEIGHT: "W"}
    out = {}
    for r in range(num_ranks):
        runner = SimpleNamespace(pp_group_size=num_ranks, _n_microbatches=num_mb)
        acts = ScheduleDualPipeV._calculate_single_rank_operations(runner, r)
        out[r] = [f"{x.stage_index}{kinds[x.computation_type]}{x.microbatch_index}"
                  for a in acts for x in (a.sub_actions or (a,))]
    return out


def _deepspeed_dualpipev(num_ranks, num_mb):
    """DeepSpeed 0.19.8's DualPipeVSchedule's compute per rank (its backward is fused: B)."""
    from deepspeed.runtime.pipe.schedule import BackwardPass, DualPipeVSchedule, ForwardPass

    out = {}
    for r in range(num_ranks):
        acts = []
        for step in DualPipeVSchedule(micro_batches=num_mb, stages=num_ranks, stage_id=r).steps():
            for cmd in step:
                if isinstance(cmd, (ForwardPass, BackwardPass)):
                    stage = r if cmd.phase == 0 else 2 * num_ranks - 1 - r
                    kind = K.FORWARD if isinstance(cmd, ForwardPass) else K.BACKWARD
                    acts.append(Action(stage, kind, cmd.buffer_id % num_mb))
        out[r] = acts
    return out


@pytest.mark.parametrize("num_ranks,num_mb", [(1, 2), (2, 4), (2, 5), (3, 7), (4, 8), (4, 16)])
def test_dualpipev_on_a_chain_is_torchs_order_action_for_action(num_ranks, num_mb):
    from gpp_deepspeed.schedule.virtual import dualpipev_orders

    orders = dualpipev_orders(StageGraph.chain(2 * num_ranks), num_mb, Fold.v_shape(num_stages=2 * num_ranks))
    assert {r: [str(a) for a in acts] for r, acts in orders.items()} == _torch_dualpipev(num_ranks, num_mb)


@pytest.mark.parametrize("num_ranks", [2, 3, 4, 8])
def test_dualpipev_bubble_and_peak_on_a_chain_against_deepspeeds_and_zbv(num_ranks):
    # Half-stages of unit layers, T_F = T_I = T_W, 16 (or 2R) micro-batches: the bubble is
    # (R - 1) T_F of a half-stage, every rank holds 2R + 1 half-stage micro-batches (ZB-V's 2R plus
    # one, the "PP + 1" of DualPipe's table), and DeepSpeed's DualPipeV (the same order with the
    # backward fused, arXiv 2412.19437's W not deferred) is no faster. ZB-V's order (zbv's here)
    # is as short with one micro-batch less a rank (its 2R).
    from gpp_deepspeed.schedule.virtual import FOLDED_SCHEDULES, rank_peak, dualpipev_orders

    chain, fold, m = StageGraph.chain(2 * num_ranks), Fold.v_shape(num_stages=2 * num_ranks), max(16, 2 * num_ranks)
    orders = dualpipev_orders(chain, m, fold)
    time = rank_makespan(orders, chain, priced(HALF))
    assert time == 3.0 * m + (num_ranks - 1) * HALF["F"]
    assert [rank_peak(orders[r], None) for r in orders] == [2 * num_ranks + 1] * num_ranks
    deepspeed = _deepspeed_dualpipev(num_ranks, m)
    assert time <= rank_makespan(deepspeed, chain, priced(HALF))
    assert max(rank_peak(deepspeed[r], None) for r in deepspeed) == 2 * num_ranks + 1
    zbv = FOLDED_SCHEDULES["zbv"][1](chain, m, fold, duration=priced(HALF))
    assert rank_makespan(zbv, chain, priced(HALF)) == time
    assert [rank_peak(zbv[r], None) for r in zbv] == [2 * num_ranks] * num_ranks


def _random_two_stage_fold(seed):
    """A random DAG of 2R stages, each rank two (a V in topological order for odd seeds, any pairing
    for even ones), and a micro-batch count of 2R to 2R + 4."""
    rng = random.Random(seed)
    num_ranks = rng.randint(1, 4)
    graph = _random_dag(rng, 2 * num_ranks)
    if seed % 2:
        fold = Fold.v_shape(num_stages=2 * num_ranks)
    else:
        pairs = list(range(num_ranks)) * 2
        rng.shuffle(pairs)
        first: dict[int, int] = {}
        fold = Fold(tuple(first.setdefault(x, len(first)) for x in pairs))
    return graph, fold, rng.randint(2 * num_ranks, 2 * num_ranks + 4)


@pytest.mark.parametrize("seed", range(16))
def test_dualpipev_folded_programs_of_random_dags_run_under_nccl_semantics(seed):
    # Random DAGs of 2R stages, each rank two stages (a V in topological order, or any pairing):
    # fold_program raises unless the rendezvous simulation completes and validate_folded passes.
    from gpp_deepspeed.schedule.validate import simulate
    from gpp_deepspeed.schedule.virtual import dualpipev_orders, fold_program

    graph, fold, num_mb = _random_two_stage_fold(seed)
    orders = dualpipev_orders(graph, num_mb, fold)
    program = fold_program(graph, num_mb, fold, orders)
    timeline = simulate(program, duration=priced(FULL))
    # Not equal to the order's replay: a stage that sends no input gradient runs its I and W as one
    # B where the W stood (fold_program's merge), which moves its work by up to one unit either way.
    end = max(e for spans in timeline.spans.values() for _, _, e in spans)
    assert abs(end - rank_makespan(orders, graph, priced(FULL))) <= FULL["F"]


@pytest.mark.parametrize("seed", range(16))
def test_zbv_runs_zb_vs_rhythm_on_random_dag_folds_where_no_slower_and_its_programs_run_under_nccl_semantics(seed):
    # Random DAGs of 2R stages, each rank two stages (a V in topological order, or any pairing).
    from gpp_deepspeed.schedule.greedy import fold_in_flight
    from gpp_deepspeed.schedule.virtual import FOLDED_SCHEDULES, fold_program, zbv_rhythm

    graph, fold, num_mb = _random_two_stage_fold(seed)
    orders = FOLDED_SCHEDULES["zbv"][1](graph, num_mb, fold)
    greedy = rank_orders(graph, num_mb, fold, split_backward=True, by_microbatch=True,
                         max_in_flight=fold_in_flight(graph, fold))
    try:
        rhythm = zbv_rhythm(graph, num_mb, fold)
        rhythm_time = rank_makespan(rhythm, graph)
    except ScheduleError:      # not two stages of different depths a rank, or it deadlocks here
        rhythm, rhythm_time = None, None
    no_slower = rhythm_time is not None and rhythm_time <= rank_makespan(greedy, graph)
    assert orders == (rhythm if no_slower else greedy)
    fold_program(graph, num_mb, fold, orders)   # raises unless it runs under NCCL's rendezvous


def test_zbvs_rhythm_on_a_dags_v_is_no_longer_than_the_greedy_order_and_less_exposed_to_message_latency():
    # benchmarks/peers.py's two branches (4 and 2 layers into a trunk of 2) in half-layer stages, in
    # a V, priced with its sleeps (10 ms a half-layer action; a branch's first layer takes no I).
    from gpp_deepspeed.schedule.greedy import fold_in_flight
    from gpp_deepspeed.schedule.validate import simulate
    from gpp_deepspeed.schedule.virtual import FOLDED_SCHEDULES, fold_program, zbv_rhythm

    layers = [("b0_0", []), ("b0_1", ["b0_0"]), ("b0_2", ["b0_1"]), ("b0_3", ["b0_2"]), ("b1_0", []),
              ("b1_1", ["b1_0"]), ("t0", ["b0_3", "b1_1"]), ("t1", ["t0"])]
    second, edges = {}, []
    for name, inputs in layers:
        first = 2 * len(second)
        second[name] = first + 1
        edges += [StageEdge(second[x], first, ()) for x in inputs] + [StageEdge(first, first + 1, ())]
    graph, fold = StageGraph(num_stages=16, edges=tuple(edges), output_stage=15), Fold.v_shape(num_stages=16)
    sources = {0, 1, 8, 9}
    sleeps = lambda a: 0.01 * {"F": 1, "I": 0 if a.stage_idx in sources else 1, "W": 1,  # noqa: E731
                               "B": 1 if a.stage_idx in sources else 2}.get(a.kind.value, 0)
    zbv = FOLDED_SCHEDULES["zbv"][1](graph, 16, fold, duration=sleeps)
    greedy = rank_orders(graph, 16, fold, split_backward=True, duration=sleeps, by_microbatch=True,
                         max_in_flight=fold_in_flight(graph, fold))
    assert zbv == zbv_rhythm(graph, 16, fold) != greedy
    steps = {name: [simulate(fold_program(graph, 16, fold, orders), duration=sleeps, latency=latency,
                             rank_of=fold.rank_of).makespan for latency in (0.0, 0.001, 0.0025)]
             for name, orders in (("rhythm", zbv), ("greedy", greedy))}
    # The whole programs, transfers and the labels' loads included: 1,010 / 1,045 / 1,098 ms against
    # 1,080 / 1,179 / 1,327 at 0, 1 and 2.5 ms a message.
    assert steps["rhythm"][0] <= steps["greedy"][0]
    assert steps["rhythm"][1] < 0.95 * steps["greedy"][1] and steps["rhythm"][2] < 0.9 * steps["greedy"][2]


def test_dualpipev_refuses_a_rank_without_two_stages_and_too_few_micro_batches():
    from gpp_deepspeed.schedule.virtual import dualpipev_orders

    with pytest.raises(ScheduleError, match=r"rank 0 holds stages \[0, 2, 4\]"):
        dualpipev_orders(StageGraph.chain(6), 8, Fold.looped(num_stages=6, num_ranks=2))
    with pytest.raises(ScheduleError, match="at least 7 micro-batches for rank 0"):
        dualpipev_orders(StageGraph.chain(8), 6, Fold.v_shape(num_stages=8))


def test_interleaved_1f1b_never_pairs_a_backward_with_a_forward_run_before_its_own():
    # The diamond looped on 2 ranks: rank 1 holds stages 1 and 3, whose chunk order would pair 3B0
    # with 1F1, before 3F0, under Megatron's warm-up alone.
    from gpp_deepspeed.schedule.virtual import fold_program

    diamond = StageGraph(num_stages=4, edges=tuple(StageEdge(s, t, ()) for s, t in ((0, 1), (0, 2), (1, 3), (2, 3))),
                         output_stage=3)
    fold = Fold.looped(num_stages=4, num_ranks=2)
    orders = interleaved_1f1b(diamond, 4, fold)
    for acts in orders.values():
        for i, a in enumerate(acts):
            if a.kind is K.BACKWARD:
                assert Action(a.stage_idx, K.FORWARD, a.mb_idx) in acts[:i], a
    fold_program(diamond, 4, fold, orders)


def test_the_fold_search_beyond_brute_force_is_no_worse_than_the_looped_and_v_folds():
    # 10 stages on 5 ranks: 945 groupings, over the brute-force limit, so the local search runs.
    from gpp_deepspeed.planner.fold_search import _BRUTE_FORCE_LIMIT, _groupings, search_fold

    graph = StageGraph.chain(10)
    assert sum(1 for _ in _groupings(10, 5, 2)) > _BRUTE_FORCE_LIMIT
    work = {s: 1.0 + 0.25 * (s % 3) for s in range(10)}
    unit = lambda a: work[a.stage_idx] * HALF.get(a.kind.value, 0.0)  # noqa: E731
    found = search_fold(graph, 10, num_ranks=5, duration=unit)
    for fold in (Fold.looped(num_stages=10, num_ranks=5), Fold.v_shape(num_stages=10)):
        for orders in (interleaved_1f1b(graph, 10, fold), rank_orders(graph, 10, fold, split_backward=True,
                                                                        duration=unit, by_microbatch=True)):
            assert found.makespan <= rank_makespan(orders, graph, unit)


def test_two_channels_between_the_same_two_ranks_share_one_wire_in_the_simulator():
    # A V on four stages: rank 0 (stages 0, 3) sends rank 1 (stages 1, 2) activations on 0 -> 1 and
    # gradients on 3 -> 2. Per stage channel both orders look fine; on the wire (messages between
    # two ranks match in posting order) the receiver must take them in the order they were sent.
    from gpp_deepspeed.schedule.ir import Action
    from gpp_deepspeed.schedule.validate import simulate

    rank0 = [Action.parse(t) for t in ("0SEND_F0@1", "3SEND_B0@2", "0WAIT_SENDS")]
    crossed = {0: rank0, 1: [Action.parse(t) for t in ("2RECV_B0@3", "1RECV_F0@0")]}
    simulate(crossed, mode="async")                        # per stage pair: nothing wrong
    with pytest.raises(ScheduleError, match="post their messages in different orders"):
        simulate(crossed, mode="async", rank_of=(0, 1, 1, 0))
    in_order = {0: rank0, 1: [Action.parse(t) for t in ("1RECV_F0@0", "2RECV_B0@3")]}
    simulate(in_order, mode="async", rank_of=(0, 1, 1, 0))
