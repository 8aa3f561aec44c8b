"""The schedule IR: our generators against torch's own pipeline_order, and the simulator against the papers."""
import pytest
from torch.distributed.pipelining import schedules as S
from torch.distributed.pipelining.stage import _PipelineStageBase

from cost_models.errors import ConfigError
from cost_models.schedule import Action, StageCost, generate, parse_order, format_order, simulate


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


TORCH = {"gpipe": S.ScheduleGPipe, "1f1b": S.Schedule1F1B, "interleaved-1f1b": S.ScheduleInterleaved1F1B,
         "zb-interleaved": S.ScheduleInterleavedZeroBubble}


def torch_order(name, p, m, v):
    if name in ("gpipe", "1f1b"):
        sched = TORCH[name](MockStage(0, p, p), n_microbatches=m)
    else:
        sched = TORCH[name]([MockStage(i * p, p * v, p) for i in range(v)], n_microbatches=m)
    compute = (S._ComputationType.FORWARD, S._ComputationType.FULL_BACKWARD,
               S._ComputationType.BACKWARD_INPUT, S._ComputationType.BACKWARD_WEIGHT)
    return {r: [str(a) for a in acts if a is not None and a.computation_type in compute]
            for r, acts in sched.pipeline_order.items()}


CASES = [("gpipe", p, m, 1) for p in (2, 4) for m in (2, 4, 8)] + \
        [("1f1b", p, m, 1) for p in (2, 3, 4) for m in (4, 8)] + \
        [(name, p, m, v) for name in ("interleaved-1f1b", "zb-interleaved") for p in (2, 4) for m in (2, 4, 8, 12)
         for v in (2, 3)] + [("zb-interleaved", 4, 8, 1)]


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
        kinds = ("F", "I", "W") if name == "zb-interleaved" else ("F", "B")
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
        sim = simulate(generate(name, p, m), costs, p=p)
        assert sim.bubble_ratio == pytest.approx((p - 1) / m, rel=1e-12)
        assert sim.makespan_s == pytest.approx((m + p - 1) * 3.0)
    gpipe = simulate(generate("gpipe", p, m), costs, p=p)
    ofob = simulate(generate("1f1b", p, m), costs, p=p)
    assert gpipe.peak_in_flight[0] == m                 # GPipe: every micro-batch before any backward
    assert ofob.peak_in_flight[0] == min(p, m)          # 1F1B: at most p on the first stage
    assert max(ofob.peak_in_flight.values()) <= p


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 16, 4), (2, 8, 3)])
def test_interleaved_bubble_is_divided_by_v(p, m, v):
    costs = [StageCost(fwd_s=1.0 / v, bwd_s=2.0 / v) for _ in range(p * v)]
    sim = simulate(generate("interleaved-1f1b", p, m, v), costs, p=p)
    assert sim.bubble_ratio == pytest.approx((p - 1) / (v * m), rel=1e-12)


def test_zero_bubble_beats_interleaved_and_p2p_costs_time():
    p, m, v = 4, 8, 2
    costs = [StageCost(fwd_s=0.5, bwd_s=1.0) for _ in range(p * v)]
    zb = simulate(generate("zb-interleaved", p, m, v), costs, p=p)
    il = simulate(generate("interleaved-1f1b", p, m, v), costs, p=p)
    assert zb.bubble_ratio < il.bubble_ratio
    slow = [StageCost(fwd_s=0.5, bwd_s=1.0, send_fwd_s=0.2, send_bwd_s=0.2) for _ in range(p * v)]
    assert simulate(generate("interleaved-1f1b", p, m, v), slow, p=p).makespan_s > il.makespan_s
    busy = sum(zb.busy_s.values())
    assert busy == pytest.approx(p * v * m * 1.5)  # every F, I and W ran once


def test_schedule_constraints_are_config_errors():
    with pytest.raises(ConfigError, match="at least as many micro-batches"):
        generate("1f1b", 4, 2)
    with pytest.raises(ConfigError, match="v >= 2"):
        generate("interleaved-1f1b", 2, 4, 1)
    with pytest.raises(ConfigError, match="unknown schedule"):
        generate("dualpipe", 2, 4)
