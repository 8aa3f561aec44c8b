"""The schedule IR: our generators against torch's own pipeline_order, and the simulator against the papers."""
import random

import pytest
from torch.distributed.pipelining import schedules as S
from torch.distributed.pipelining.stage import _PipelineStageBase

from cost_models.cost.simulator import ScheduleDeadlock, StageCost, simulate
from cost_models.records.errors import ConfigError
from cost_models.records.schedule import SCHEDULES, Action, format_grid, format_order, generate, parse_order


class MockStage(_PipelineStageBase):
    """Enough of a pipeline stage for torch's schedule classes to build their pipeline_order, without a
    process group (as torch's own test_schedule.py does)."""

    def __init__(self, stage_index: int, num_stages: int, group_size: int) -> None:
        self.submod = None
        self.stage_index, self.num_stages = stage_index, num_stages
        self.group_size, self.group_rank, self.group = group_size, 0, None
        self.stage_index_to_group_rank = {}
        self.has_backward = True

    def _create_grad_recv_info(self, *args, **kwargs):
        return ()

    def _prepare_forward_infra(self, *args, **kwargs):
        return ()

    def _prepare_backward_infra(self, *args, **kwargs):
        return None


TORCH = {name: getattr(S, spec.torch_class) for name, spec in SCHEDULES.items()}


def torch_order(name, p, m, v):
    if issubclass(TORCH[name], S.PipelineScheduleSingle):
        sched = TORCH[name](MockStage(0, p, p), n_microbatches=m)
    else:   # rank 0's stages, as the registry places them (torch builds every rank's order from any rank)
        stages = SCHEDULES[name].rank_stages(0, p, v)
        sched = TORCH[name]([MockStage(sid, p * v, p) for sid in stages], n_microbatches=m)
    compute = (S._ComputationType.FORWARD, S._ComputationType.FULL_BACKWARD,
               S._ComputationType.BACKWARD_INPUT, S._ComputationType.BACKWARD_WEIGHT)
    return {r: [str(a) for a in acts if a is not None and a.computation_type in compute]
            for r, acts in sched.pipeline_order.items()}


CASES = [("gpipe", p, m, 1) for p in (2, 4) for m in (2, 4, 8)] + \
        [("1f1b", p, m, 1) for p in (2, 3, 4) for m in (4, 8)] + \
        [(name, p, m, v) for name in ("interleaved-1f1b", "zb-interleaved") for p in (2, 4) for m in (2, 4, 8, 12)
         for v in (2, 3)] + [("zb-interleaved", 4, 8, 1)] + \
        [("zbv", p, m, 2) for p in (2, 3, 4) for m in (1, 2, 3, 4, 5, 8, 12)]


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_generated_orders_equal_torchs_pipeline_order(name, p, m, v):
    ours = {r: [str(a) for a in acts] for r, acts in generate(name, p, m, v).items()}
    theirs = torch_order(name, p, m, v)
    ranks = range(p)
    if name == "1f1b":
        # torch 2.13's Schedule1F1B._get_pipeline_order (a description; its runtime does not read it) numbers the
        # last rank's forwards from 1 (3F1 .. 3F8 for m=8). Its runtime, and ours, run F0 B0 F1 B1 ... there.
        ranks = range(p - 1)
        assert ours[p - 1][:4] == [f"{p - 1}F0", f"{p - 1}B0", f"{p - 1}F1", f"{p - 1}B1"]
    for r in ranks:
        assert ours[r] == theirs[r], f"rank {r}"


def test_every_action_appears_once():
    for name, p, m, v in CASES:
        order = generate(name, p, m, v)
        acts = [a for r in order.values() for a in r]
        kinds = ("F", "I", "W") if SCHEDULES[name].split_backward else ("F", "B")
        assert sorted(acts) == sorted(Action(s, k, i) for s in range(p * v) for k in kinds for i in range(m))


def test_ir_round_trips_as_strings():
    order = generate("zb-interleaved", 2, 4, 2)
    assert parse_order(format_order(order)) == order
    assert str(Action.parse("12W3")) == "12W3"
    with pytest.raises(ValueError):
        Action.parse("0X1")


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16), (8, 8), (3, 5)])
def test_bubble_is_p_minus_1_over_m(p, m):
    # Narayanan et al. 2021, section 2.2: equal stages, free p2p: bubble / ideal = (p-1)/m for GPipe and 1F1B.
    costs = [StageCost(fwd_s=1.0, bwd_s=2.0, activation_bytes=1.0) for _ in range(p)]
    for name in ("gpipe", "1f1b"):
        sim = simulate(generate(name, p, m), costs)
        assert sim.bubble_ratio == pytest.approx((p - 1) / m, rel=1e-12)
        assert sim.makespan_s == pytest.approx((m + p - 1) * 3.0)
    gpipe = simulate(generate("gpipe", p, m), costs)
    ofob = simulate(generate("1f1b", p, m), costs)
    assert gpipe.peak_in_flight[0] == m                 # GPipe: every micro-batch before any backward
    assert ofob.peak_in_flight[0] == min(p, m)          # 1F1B: at most p on the first stage
    assert max(ofob.peak_in_flight.values()) <= p


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 16, 4), (2, 8, 3)])
def test_interleaved_bubble_is_divided_by_v(p, m, v):
    costs = [StageCost(fwd_s=1.0 / v, bwd_s=2.0 / v) for _ in range(p * v)]
    sim = simulate(generate("interleaved-1f1b", p, m, v), costs)
    assert sim.bubble_ratio == pytest.approx((p - 1) / (v * m), rel=1e-12)


def test_zero_bubble_beats_interleaved_and_p2p_costs_time():
    p, m, v = 4, 8, 2
    costs = [StageCost(fwd_s=0.5, bwd_s=1.0) for _ in range(p * v)]
    zb = simulate(generate("zb-interleaved", p, m, v), costs)
    il = simulate(generate("interleaved-1f1b", p, m, v), costs)
    assert zb.bubble_ratio < il.bubble_ratio
    slow = [StageCost(fwd_s=0.5, bwd_s=1.0, send_fwd_s=0.2, send_bwd_s=0.2) for _ in range(p * v)]
    assert simulate(generate("interleaved-1f1b", p, m, v), slow).makespan_s > il.makespan_s
    busy = sum(zb.busy_s.values())
    assert busy == pytest.approx(p * v * m * 1.5)  # every F, I and W ran once


def test_schedule_constraints_are_config_errors():
    with pytest.raises(ConfigError, match="at least as many micro-batches"):
        generate("1f1b", 4, 2)
    with pytest.raises(ConfigError, match="v >= 2"):
        generate("interleaved-1f1b", 2, 4, 1)
    with pytest.raises(ConfigError, match="unknown schedule"):
        generate("dualpipe", 2, 4)


@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.parametrize("p,v", [(2, 2), (4, 2), (3, 3)])
def test_placement_is_torchs(name, p, v):
    # torch's generate_stage_to_rank_mapping (style "loop" or "v") is what its schedules send activations by
    spec = SCHEDULES[name]
    theirs = S.generate_stage_to_rank_mapping(p, p * v, style=spec.placement)
    assert {sid: spec.stage_rank(sid, p) for sid in range(p * v)} == theirs
    for r in range(p):
        assert spec.rank_stages(r, p, v) == tuple(sorted(sid for sid, rank in theirs.items() if rank == r))


def test_zbv_puts_both_ends_on_rank_0_and_beats_the_looped_schedules():
    p, m = 4, 8
    assert SCHEDULES["zbv"].rank_stages(0, p, 2) == (0, 2 * p - 1)
    # equal F, I and W (the ZB-V paper's setting, Qi et al. 2024 section 6): a sixth of 1F1B's idle time with the
    # same work per rank, and less than interleaved 1F1B's
    chunk = [StageCost(fwd_s=1.0, bwd_s=2.0) for _ in range(2 * p)]
    zbv = simulate(generate("zbv", p, m, 2), chunk)
    interleaved = simulate(generate("interleaved-1f1b", p, m, 2), chunk)
    ofob = simulate(generate("1f1b", p, m), [StageCost(fwd_s=2.0, bwd_s=4.0) for _ in range(p)])
    assert sum(zbv.busy_s.values()) == pytest.approx(2 * p * m * 3.0)   # every F, I and W ran once
    assert zbv.bubble_ratio == pytest.approx(ofob.bubble_ratio / 6) and ofob.bubble_ratio == pytest.approx((p - 1) / m)
    assert zbv.bubble_ratio < interleaved.bubble_ratio
    # the V's turn (stage p-1 -> p) stays on rank p-1: with p2p costs ZB-V ends before looped zero bubble
    slow = [StageCost(fwd_s=1.0, bwd_s=2.0, send_fwd_s=0.5, send_bwd_s=0.5) for _ in range(2 * p)]
    zbv_slow = simulate(generate("zbv", p, m, 2), slow).makespan_s
    assert zbv.makespan_s < zbv_slow < simulate(generate("zb-interleaved", p, m, 2), slow).makespan_s


def test_a_deadlock_prints_the_grid_with_the_stuck_actions_marked():
    order = {0: [Action(0, "F", 0), Action(0, "B", 0)], 1: [Action(1, "B", 0), Action(1, "F", 0)]}
    with pytest.raises(ScheduleDeadlock) as info:
        simulate(order, [StageCost(fwd_s=1.0, bwd_s=1.0)] * 2)
    text = str(info.value)
    assert "{0: '0B0', 1: '1B0'}" in text
    rows = text.splitlines()[1:]
    assert rows[0].split() == ["step", "rank", "0", "rank", "1"]
    assert rows[1].split() == ["0", "0F0", ">1B0"] and rows[2].split() == ["1", ">0B0", "1F0"]
    assert format_grid(generate("1f1b", 2, 2)).splitlines()[1].split() == ["0", "0F0", "1F0"]


def test_the_executor_names_the_first_action_torch_ran_differently():
    from executor.pipeline import ActionLog, check_order
    order = generate("1f1b", 2, 4)
    log = ActionLog([], order, pp_rank=1)
    log.ran = list(order[1])
    log.check_step()                       # equal: no error, and the log starts again
    assert log.ran == []
    log.ran = list(order[1])
    log.ran[2], log.ran[3] = log.ran[3], log.ran[2]
    with pytest.raises(RuntimeError, match=r"ran 1B1 at step 2 on pipeline rank 1 where the plan has 1F1") as info:
        log.check_step()
    assert ">1F1" in str(info.value)
    with pytest.raises(RuntimeError, match=r"would run nothing at step 4"):
        check_order({1: list(order[1])[:4]}, order, 1)


def test_schedule_names_appear_in_product_code_only_in_the_registry():
    import ast
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    files = [*root.glob("cost_models/**/*.py"), *root.glob("planner/*.py"), *root.glob("executor/*.py"), root / "cli.py"]
    found = [f"{f.relative_to(root)}:{node.lineno} {node.value!r}" for f in files if f.name != "schedule.py"
             for node in ast.walk(ast.parse(f.read_text())) if isinstance(node, ast.Constant) and node.value in SCHEDULES]
    assert not found, found


def test_zbv_is_planned_for_an_untied_model_and_not_where_a_tie_would_share_a_rank():
    from cost_models.models.source import resolve
    from cost_models.profiling.model_profiler import profile_model
    from cost_models.records.presets import preset
    from planner.request import PlanRequest
    from planner.search import search
    request = PlanRequest(gpus=2, global_batch_size=8, precision="fp32", prune=False, schedules=("zbv",))
    llama = profile_model(resolve("llama-tiny"), micro_batch_size=1, seq_len=16, meta=True, dtype="fp32")
    found = search(llama, preset("dgx-a100"), request)
    zbv = [c for c in found.feasible if c.strategy.pp > 1]
    assert zbv and all(c.strategy.schedule == "zbv" and c.strategy.v == 2 for c in zbv)
    best = zbv[0].strategy
    assert best.stage_ranks(0) == best.stage_ranks(3) == (0,) and best.stage_ranks(1) == (1,)
    gpt = profile_model(resolve("gpt-tiny"), micro_batch_size=1, seq_len=16, meta=True, dtype="fp32")
    assert gpt.shared   # tied embedding and head: the first and the last stage, both on rank 0 in a V
    assert not [c for c in search(gpt, preset("dgx-a100"), request).feasible if c.strategy.pp > 1]


def test_the_estimate_holds_zbv_stages_where_the_v_puts_them():
    from cost_models.cost.estimate import estimate
    from cost_models.cost.memory import executor_state_bytes
    from cost_models.models.source import resolve
    from cost_models.profiling.model_profiler import profile_model
    from cost_models.records.presets import preset
    from cost_models.records.strategy import Strategy
    prof = profile_model(resolve("llama-tiny"), micro_batch_size=1, seq_len=16, meta=True, dtype="fp32")
    names = [u.name for u in prof.units]
    stages = (tuple(names[:2]), (names[2],), (names[3],), tuple(names[4:]))
    s = Strategy(dp=1, pp=2, zero=0, schedule="zbv", microbatches=4, micro_batch_size=2, v=2, stages=stages,
                 precision="fp32", optimizer="adamw")
    est = estimate(s, prof, preset("dgx-a100"))
    assert [st.pp_rank for st in est.stages] == [0, 1, 1, 0]
    assert [m.stages for m in est.memory_per_rank] == [(0, 3), (1, 2)]
    held = est.stages[0].params + est.stages[3].params
    assert held == sum(u.params for u in prof.units if u.name in stages[0] + stages[3])
    assert est.memory_per_rank[0].parameters == executor_state_bytes(held, 1, 0, "fp32", "adamw")[0]
    assert est.pipeline_order == format_order(generate("zbv", 2, 4, 2))
    # the V's turn (stage 1 -> 2, both on rank 1) is handed over in memory: no p2p time, no p2p bytes
    assert est.stages[1].send_fwd_s == 0 and est.stages[2].send_bwd_s == 0 and est.stages[0].send_fwd_s > 0
    crossing = est.stages[0].boundary_bytes + est.stages[2].boundary_bytes
    assert est.comm.p2p_bytes_per_step == 2 * crossing * 4 and est.comm.p2p_link.endswith("of 2 stage boundaries inter-node")


def _reference_times(order, costs):
    """Every action's (start, end) by relaxation to a fixed point, the dependency rules written out afresh: a
    second implementation for the simulator's single topological pass to agree with."""
    where = {a.stage: r for r, acts in order.items() for a in acts}
    dur = {"F": lambda c: c.fwd_s, "B": lambda c: c.bwd_s, "I": lambda c: c.bwd_s * c.bwd_input_fraction,
           "W": lambda c: c.bwd_s * (1 - c.bwd_input_fraction)}
    end: dict = {}
    last = len(costs) - 1
    while True:
        changed = False
        for r, acts in order.items():
            clock = 0.0
            for a in acts:
                s, i = a.stage, a.mb
                back = lambda st: end.get((st, "B", i), end.get((st, "I", i)))
                if a.kind == "F":
                    deps = [] if s == 0 else [(end.get((s - 1, "F", i)), costs[s - 1].send_fwd_s, s - 1)]
                elif a.kind == "W":
                    deps = [(end.get((s, "I", i)), 0.0, s)]
                else:
                    deps = [(end.get((s, "F", i)), 0.0, s)] + ([] if s == last else [(back(s + 1), costs[s + 1].send_bwd_s, s + 1)])
                if any(t is None for t, _, _ in deps):
                    break
                start = max([clock] + [t + (send if where[st] != r else 0.0) for t, send, st in deps])
                # micro-batch 0 pays the stage's one-off extras (a ZeRO-2/3 stage's FSDP gather) on F and on B / I
                extra = {"F": costs[s].first_fwd_extra_s, "B": costs[s].first_bwd_extra_s,
                         "I": costs[s].first_bwd_extra_s}.get(a.kind, 0.0) if i == 0 else 0.0
                clock = start + dur[a.kind](costs[s]) + extra
                if end.get((s, a.kind, i)) != clock:
                    end[s, a.kind, i], changed = clock, True
        if not changed:
            return end


def test_the_simulator_agrees_with_a_fixed_point_reference():
    rng = random.Random(7)
    for name, spec in SCHEDULES.items():
        for p, m in ((1, 3), (2, 4), (3, 6), (4, 8)):
            for v in spec.searched_v:
                if spec.constraint(name, p, m, v):
                    continue
                costs = [StageCost(fwd_s=rng.uniform(0.5, 2), bwd_s=rng.uniform(1, 4), bwd_input_fraction=rng.random(),
                                   send_fwd_s=rng.uniform(0, 0.5), send_bwd_s=rng.uniform(0, 0.5),
                                   first_fwd_extra_s=rng.choice((0.0, rng.uniform(0, 1))),
                                   first_bwd_extra_s=rng.choice((0.0, rng.uniform(0, 1)))) for _ in range(p * v)]
                order = generate(name, p, m, v)
                sim = simulate(order, costs, keep_timeline=True)
                ref = _reference_times(order, costs)
                assert len(sim.timeline) == len(ref) == sum(len(a) for a in order.values())
                for e in sim.timeline:
                    assert e.end_s == pytest.approx(ref[e.action.stage, e.action.kind, e.action.mb], abs=1e-12)
                assert sim.makespan_s == pytest.approx(max(ref.values()), abs=1e-12)


def test_micro_batch_0_pays_a_stages_one_off_extras():
    """A ZeRO-2/3 stage's FSDP gather delays its first forward (and under ZeRO-3 its first backward), on the
    pipeline's path (estimate._stage_gather). GPipe, 2 stages, 2 micro-batches, forward 1 s, backward 2 s, no
    sends; stage 1 gathers 0.5 s before its first forward and 0.25 s before its first backward, worked by hand:
    rank 1 runs F0 1-2.5, F1 2.5-3.5, B0 3.5-5.75, B1 5.75-7.75; rank 0's B0 5.75-7.75, B1 7.75-9.75 (9 without)."""
    from cost_models.cost.simulator import simulate_schedule
    plain = StageCost(fwd_s=1.0, bwd_s=2.0)
    gathered = StageCost(fwd_s=1.0, bwd_s=2.0, first_fwd_extra_s=0.5, first_bwd_extra_s=0.25)
    assert simulate_schedule("gpipe", 2, 2, 1, (plain, plain)).makespan_s == pytest.approx(9.0)
    sim = simulate(generate("gpipe", 2, 2), (plain, gathered), keep_timeline=True)
    assert sim.makespan_s == pytest.approx(9.75)
    span = {(e.action.stage, e.action.kind, e.action.mb): (e.start_s, e.end_s) for e in sim.timeline}
    assert span[1, "F", 0] == pytest.approx((1.0, 2.5)) and span[1, "F", 1] == pytest.approx((2.5, 3.5))
    assert span[1, "B", 0] == pytest.approx((3.5, 5.75)) and span[1, "B", 1] == pytest.approx((5.75, 7.75))
    assert sim.busy_s[1] == pytest.approx(6.75) and sim.busy_s[0] == pytest.approx(6.0)


def test_deferred_sends_leave_when_the_sender_next_waits_or_the_delay_ends():
    """gloo on CPU ranks whose cores are all busy: a send leaves when its rank next waits on a receive, or
    send_delay_s after it was posted (simulator._evaluate). GPipe, 2 stages, 2 micro-batches, forward 1 s, backward
    2 s, each send 0.1 s, worked by hand:
    plain:    rank 1 runs F0 1.1-2.1, F1 2.1-3.1, B0 3.1-5.1, B1 5.1-7.1; rank 0's B0 5.2-7.2, B1 7.2-9.2.
    deferred: rank 0 computes F1 before it next waits, so F0's output arrives at 2 (the send's 0.1 s is inside
    that wait): rank 1's F0 2-3, F1 3-4 (F1's output arrives at 2.1: B0 receives next), B0 4-6, B1 6-8; B0's
    gradient arrives when rank 1 is done, at 8: rank 0's B0 8-10, B1 10-12.
    at most 0.5 s late: F0's output arrives at 1.5 (rank 1's F0 1.5-2.5), F1's at 2.1 (F1 2.5-3.5, B0 3.5-5.5),
    B0's gradient at 6.0 (rank 0's B0 6-8), B1's (B1 5.5-7.5) at 7.6 (rank 0's B1 8-10)."""
    from cost_models.cost.simulator import simulate_schedule
    costs = tuple(StageCost(fwd_s=1.0, bwd_s=2.0, send_fwd_s=0.1, send_bwd_s=0.1) for _ in range(2))
    assert simulate_schedule("gpipe", 2, 2, 1, costs).makespan_s == pytest.approx(9.2)
    deferred = simulate_schedule("gpipe", 2, 2, 1, costs, send_delay_s=100.0)
    assert deferred.makespan_s == pytest.approx(12.0)
    assert deferred.finish_s == pytest.approx({0: 12.0, 1: 8.0})
    capped = simulate_schedule("gpipe", 2, 2, 1, costs, send_delay_s=0.5)
    assert capped.finish_s == pytest.approx({0: 10.0, 1: 7.5})
    # a delay shorter than the transfer changes nothing; nor, with nothing computed after a send, does any delay
    assert simulate_schedule("gpipe", 2, 2, 1, costs, send_delay_s=0.05).makespan_s == pytest.approx(9.2)
    assert simulate_schedule("gpipe", 2, 1, 1, costs, send_delay_s=100.0).makespan_s == pytest.approx(
        simulate_schedule("gpipe", 2, 1, 1, costs).makespan_s)
