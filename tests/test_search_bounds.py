"""The search's pruning (planner/search.py P2-P8) is safe: on problems where memory binds (P6 and P7 fire), the
branch-and-bound search returns the same top plans, with the same predicted step times, as costing every point
(prune=False, which also skips the P6-P8 shortcuts). And the schedule facts P6 relies on hold in the simulator."""
import functools
import random

import pytest

from cost_models.cost.simulator import StageCost, simulate
from cost_models.models.source import resolve
from cost_models.profiling.model_profiler import profile_model
from cost_models.records.presets import preset
from cost_models.records.schedule import SCHEDULES, forwards_before_backward, generate
from planner.request import PlanRequest
from planner.search import search


@functools.lru_cache(maxsize=None)
def _llama8b(seq_len: int):
    return profile_model(resolve("llama3-8b"), micro_batch_size=1, seq_len=seq_len, meta=True, dtype="bf16")


@pytest.mark.parametrize("seq_len, batch, cluster, nodes", [
    (4096, 32, "a100-pcie-40g", 1),    # memory binds: most points recompute
    (8192, 64, "a100-pcie-40g", 1),    # it binds harder: pipelines only with recompute on every stage
    (4096, 64, "dgx-h100", 2),         # tensor parallelism in the space
    (32768, 16, "a100-pcie-40g", 1),   # long sequences: context parallelism in the space, one branch-and-bound
    (65536, 16, "dgx-h100", 2),        # over every degree, P8 and the gathers of keys and values in the bounds
])
def test_pruned_search_finds_the_exhaustive_searchs_top_plans(seq_len, batch, cluster, nodes):
    prof = _llama8b(seq_len)
    c = preset(cluster, nodes=nodes)
    narrow = dict(global_batch_size=batch, top_k=3, micro_batch_sizes=(1, 2), max_v=2)
    pruned = search(prof, c, PlanRequest(**narrow))
    every = search(prof, c, PlanRequest(prune=False, **narrow))
    assert pruned.costed < every.costed
    top = lambda found: [(x.strategy, x.estimate.step_time_s) for x in found.feasible[:3]]
    assert top(pruned) == top(every)


def test_forwards_before_the_first_backward_are_alive_together_in_the_simulation():
    rng = random.Random(3)
    for name, spec in SCHEDULES.items():
        for p, m, v in ((2, 4, 1), (4, 8, 1), (4, 8, 2), (3, 6, 2), (2, 8, 4)):
            if v not in spec.searched_v or spec.constraint(name, p, m, v):
                continue
            costs = [StageCost(fwd_s=rng.uniform(0.5, 2), bwd_s=rng.uniform(1, 4), send_fwd_s=rng.uniform(0, 0.3),
                               send_bwd_s=rng.uniform(0, 0.3), activation_bytes=rng.uniform(1, 10))
                     for _ in range(p * v)]
            sim = simulate(generate(name, p, m, v), costs)
            for rank in range(p):
                prefix = forwards_before_backward(name, rank, p, m, v)
                assert prefix and all(s in spec.rank_stages(rank, p, v) for s in prefix)
                assert sum(costs[s].activation_bytes for s in prefix) <= sim.peak_activation_bytes[rank] * (1 + 1e-12)
    assert forwards_before_backward("gpipe", 0, 4, 8) == (0,) * 8                  # every forward first
    assert forwards_before_backward("1f1b", 0, 4, 8) == (0,) * 4                   # p - rank warm-up + one
    assert forwards_before_backward("1f1b", 3, 4, 8) == (3,)


def _bounds_and_estimates(prof, cluster, req):
    """Every point's time bound (P2) beside its first estimate (the balanced cut, no recompute), as search builds
    them: a bound above its own estimate can prune a plan the exhaustive search keeps."""
    from cost_models.cost.estimate import dtype_ratio
    from planner import search as S
    at = functools.partial(S.bound_unit_times, prof, cluster, req)
    run = S._as_run(req, cluster)
    parts = S._Partitions(prof, at(prof.micro_batch_size), dtype_ratio=dtype_ratio(prof, run.precision), at_batch=at)
    gpus = req.resolved_gpus(cluster)
    points = S._points(prof, gpus, req, parts, S.search_tp(prof, cluster, gpus, req))
    for bound, pt in S._bounded(points, prof, cluster, parts, run).survivors:
        made, _ = S._cost_point(pt, prof, cluster, parts, parts.unit_cost, precision=req.precision,
                                optimizer=req.optimizer)
        yield bound, made[0].estimate.step_time_s, pt


def test_bounds_hold_for_pipelined_all_reduce_across_nodes():
    """Pipelined ZeRO-0/1 all-reduce gradients across 32 nodes, which NCCL's tree makes cheaper than the
    reduce-scatter + all-gather the bound used to add up: the pruned search then missed '8-stage zbv x 32-way
    ZeRO-0' plans the exhaustive one ranked in its top 40."""
    prof = _llama8b(128)
    c = preset("dgx-h100", nodes=32)
    req = PlanRequest(global_batch_size=256, top_k=40, tp_degrees=(1,), micro_batch_sizes=(1, 2), max_v=2)
    checked = [(b, t) for b, t, pt in _bounds_and_estimates(prof, c, req) if pt.pp > 1 and pt.zero <= 1]
    assert len(checked) > 20 and all(b <= t * (1 + 1e-9) for b, t in checked)
    top = lambda found: [(x.strategy, x.estimate.step_time_s) for x in found.feasible[:40]]
    assert top(search(prof, c, req)) == top(search(prof, c, PlanRequest(prune=False, **{
        k: getattr(req, k) for k in ("global_batch_size", "top_k", "tp_degrees", "micro_batch_sizes", "max_v")})))


def test_bounds_hold_when_a_gpu_profiles_per_sample_time_grows_with_the_batch(tiny_profiles):
    """A GPU profile's in-model gap is a fixed cost per call (compute._in_model): with units almost proportional
    to the batch, per-sample time then grows with it, and bounds scaled down from the largest micro-batch exceeded
    their estimates. Each micro-batch size is now estimated. (GPU fields set by hand: CI has no GPU.)"""
    import dataclasses

    from cost_models.records.profile import Timing
    base = tiny_profiles["gpt-tiny", False]   # real profile at micro-batch 2
    h100 = preset("dgx-h100")
    one = lambda t: Timing(median_s=t.median_s / 2 * 1.02, min_s=t.min_s / 2, max_s=t.max_s / 2, repeats=t.repeats)
    gpu = dataclasses.replace(base, device="gpu", device_name=h100.device.name, in_model_factor=0.8,
                              units=tuple(dataclasses.replace(u, fwd_time_one=one(u.fwd_time),
                                                              bwd_time_one=one(u.bwd_time)) for u in base.units))
    req = PlanRequest(global_batch_size=64, precision="fp32", micro_batch_sizes=(1, 2, 4, 8))
    checked = [(b, t) for b, t, _ in _bounds_and_estimates(gpu, h100, req)]
    assert len(checked) > 50 and all(b <= t * (1 + 1e-9) for b, t in checked)


@pytest.mark.parametrize("one_sample", [0.9, 1.1])   # of the profile's timing: most of it per call; noise above it
def test_bounds_hold_on_a_probed_cpu_cluster_above_the_profiles_micro_batch(tiny_profiles, one_sample):
    """Measured times are affine in the micro-batch (compute._at_batch): above the profile's micro-batch the fixed
    part stays whole, so bounds scaled linearly from it exceeded their estimates (at micro-batch 8 from a profile at
    2 with one sample at 0.9 of it: 4x the profile's time where the estimate has 1.6x; 1x at 1.1). Each micro-batch is now
    read off the same line."""
    import dataclasses

    from cost_models.records.profile import Timing
    from tests.clusters import cpu_cluster
    base = tiny_profiles["gpt-tiny", False]   # real profile at micro-batch 2
    one = lambda t: Timing(median_s=t.median_s * one_sample, min_s=t.min_s, max_s=t.max_s, repeats=t.repeats)  # noqa
    prof = dataclasses.replace(base, units=tuple(dataclasses.replace(u, fwd_time_one=one(u.fwd_time),
                                                                     bwd_time_one=one(u.bwd_time)) for u in base.units))
    cpu = cpu_cluster(ranks=4, threads=prof.threads, cores=2)
    req = PlanRequest(global_batch_size=32, precision="fp32", micro_batch_sizes=(1, 2, 4, 8), tp_degrees=(1,))
    checked = [(b, t, pt.micro_batch_size) for b, t, pt in _bounds_and_estimates(prof, cpu, req)]
    assert {mbs for _, _, mbs in checked} == {1, 2, 4, 8}
    assert all(b <= t * (1 + 1e-9) for b, t, _ in checked)


def test_a_cpu_clusters_search_bounds_a_bf16_request_as_the_fp32_its_ranks_run():
    """CPU ranks run every plan in fp32 (estimate.executed), so a bf16-mixed request's bounds and memory-bound
    retries count fp32 bytes: the same top plans, from the same number of estimates, as an fp32 request (with
    bf16's halved activations and bytes the bounds were looser: 51 estimates instead of 39 here)."""
    import dataclasses
    base = preset("a100-pcie-40g")
    dev = dataclasses.replace(base.device, kind="cpu", memory_bytes=60 * 2**30, peak_flops={"fp32": 1e12})
    cpu = dataclasses.replace(base, name="cpu-like", device=dev)
    narrow = dict(global_batch_size=32, top_k=3, micro_batch_sizes=(1, 2), max_v=2, tp_degrees=(1,))
    found = {p: search(_llama8b(4096), cpu, PlanRequest(precision=p, **narrow)) for p in ("bf16-mixed", "fp32")}
    top = {p: [(dataclasses.replace(x.strategy, precision="fp32"), x.estimate.step_time_s) for x in f.feasible[:3]]
           for p, f in found.items()}
    assert len(top["fp32"]) == 3 and top["bf16-mixed"] == top["fp32"]
    assert all(x.strategy.precision == "bf16-mixed" for x in found["bf16-mixed"].feasible)   # as requested
    assert found["bf16-mixed"].costed == found["fp32"].costed


def test_bounds_hold_on_a_calibrated_cluster(tiny_profiles):
    """A calibration's factors below 1 scale the estimate's compute, optimizer and data-parallel collectives; the
    search's bounds left them unscaled and exceeded their estimates (5 of 96 points at 0.5), so the pruned search
    could drop a plan the exhaustive one keeps."""
    import dataclasses

    from cost_models.records.cluster import Calibration
    from tests.clusters import cpu_cluster
    prof = tiny_profiles["gpt-tiny", False]
    cal = Calibration(compute_scale=0.5, optimizer_scale=0.5, dp_comm_scale=0.5,
                      fitted=("compute_scale", "optimizer_scale", "dp_comm_scale"))
    c = dataclasses.replace(cpu_cluster(ranks=4, threads=prof.threads, cores=2), calibration=cal)
    req = PlanRequest(global_batch_size=32, precision="fp32", micro_batch_sizes=(1, 2, 4), tp_degrees=(1,))
    checked = [(b, t) for b, t, _ in _bounds_and_estimates(prof, c, req)]
    assert len(checked) > 50 and all(b <= t * (1 + 1e-9) for b, t in checked)


def _cut(names, k):
    """`names` in k contiguous stages of near-equal length."""
    bounds = [round(i * len(names) / k) for i in range(k + 1)]
    return tuple(tuple(names[a:b]) for a, b in zip(bounds, bounds[1:]))


@pytest.mark.parametrize("calibrated", [False, True])
@pytest.mark.parametrize("dp, pp, v, tp, sp, mbs, schedule, zero", [
    (1, 1, 1, 1, False, 2, "gpipe", 0),
    (2, 2, 1, 1, False, 1, "1f1b", 1),
    (1, 2, 1, 2, False, 1, "1f1b", 0),
    (2, 2, 2, 4, True, 2, "interleaved-1f1b", 1),
    (1, 3, 1, 2, True, 4, "zb-interleaved", 0),
])
def test_the_bounds_unit_times_are_the_estimates(tiny_profiles, calibrated, dp, pp, v, tp, sp, mbs, schedule, zero):
    """The time bound's per-unit (forward, backward) on a preset (planner.search._UnitTimes) is what the estimate
    prices each unit at (estimate.unit_costs), and each of the estimate's stages is its units' sum plus the
    per-action overhead the bound leaves out: the bound reads the estimate's function, so the two cannot drift. A
    calibration's per-action overhead stays out of the units (once counted per unit, it lifted the bounds of
    multi-unit stages above their estimates). With tp = 1 a stage's parameters and activations are its units'
    held_params and saved_bytes, which the memory-aware partitioner reads."""
    import dataclasses

    from cost_models.cost.estimate import action_cost, activation_scale, estimate, held_params, saved_bytes, unit_costs
    from cost_models.records.cluster import Calibration
    from cost_models.records.strategy import Strategy
    from planner import search as S
    prof = tiny_profiles["gpt-tiny", True]
    c = preset("dgx-h100")
    if calibrated:
        c = dataclasses.replace(c, calibration=Calibration(compute_scale=0.8, pipeline_action_s=1e-3,
                                                           fitted=("compute_scale", "pipeline_action_s")))
    names = [u.name for u in prof.units]
    s = Strategy(dp=dp, pp=pp, zero=zero, schedule=schedule, microbatches=4, micro_batch_size=mbs, v=v,
                 stages=_cut(names, pp * v), tp=tp, sp=sp)
    req = PlanRequest(global_batch_size=s.global_batch_size)
    per_unit = S._UnitTimes(prof, c, S._as_run(req, c)).units(tp, sp, mbs)
    assert per_unit is not None and per_unit == unit_costs(s, prof, c)
    action = action_cost(s, c) if s.n_stages > 1 else 0.0
    scale = activation_scale(prof, micro_batch_size=mbs, precision=s.precision)
    for st in estimate(s, prof, c).stages:
        mine = [per_unit[names.index(u)] for u in st.units]
        assert st.fwd_s == pytest.approx(sum(f for f, _ in mine) + action, rel=1e-12)
        assert st.bwd_s == pytest.approx(sum(b for _, b in mine) + action * (1 + s.spec.split_backward), rel=1e-12)
        if tp == 1:
            assert st.params == sum(held_params(prof, u, st.units) for u in st.units)
            assert st.activation_bytes == pytest.approx(
                sum(saved_bytes(prof, prof.unit(u), micro_batch_size=mbs, precision=s.precision)
                    for u in st.units) * scale, rel=1e-12)


@pytest.mark.parametrize("mbs", [1, 2, 4])
def test_the_fallback_unit_times_are_the_estimates_with_one_rank_computing(tiny_profiles, mbs):
    """Where unit times depend on the ranks computing (a probed CPU cluster), the bound prices units as the
    estimate does with one rank computing (planner.search.bound_unit_times, estimate.unit_seconds), calibration
    included: a one-rank plan's estimate is its units' sum."""
    import dataclasses

    from cost_models.cost.estimate import estimate
    from cost_models.records.cluster import Calibration
    from cost_models.records.strategy import Strategy
    from planner import search as S
    from tests.clusters import cpu_cluster
    prof = tiny_profiles["gpt-tiny", False]
    c = dataclasses.replace(cpu_cluster(ranks=4, threads=prof.threads, cores=2),
                            calibration=Calibration(compute_scale=0.7, fitted=("compute_scale",)))
    names = tuple(u.name for u in prof.units)
    s = Strategy(dp=1, pp=1, zero=0, schedule="gpipe", microbatches=2, micro_batch_size=mbs, stages=(names,),
                 precision="fp32")
    req = PlanRequest(global_batch_size=s.global_batch_size, precision="fp32")
    per_unit = S.bound_unit_times(prof, c, req, mbs)
    (st,) = estimate(s, prof, c).stages
    assert st.fwd_s == pytest.approx(sum(f for f, _ in per_unit), rel=1e-12)
    assert st.bwd_s == pytest.approx(sum(b for _, b in per_unit), rel=1e-12)


def test_identical_blocks_share_their_priced_costs_and_others_do_not():
    """The estimate prices a meta profile's identical blocks once (estimate._twins): every block of llama3-8b maps to
    the first, the embedding and head to none, and a block that differs in anything priced keeps its own costs."""
    import dataclasses

    from cost_models.cost.estimate import _twins
    prof = _llama8b(4096)
    twins = _twins(prof)
    blocks = [u.name for u in prof.units if u.name.startswith("blocks.")]
    assert twins == {b: blocks[0] for b in blocks[1:]}
    odd = dataclasses.replace(prof.units[3], saved_bytes=prof.units[3].saved_bytes + 1)
    changed = dataclasses.replace(prof, units=prof.units[:3] + (odd,) + prof.units[4:])
    assert odd.name not in _twins(changed) and len(_twins(changed)) == len(blocks) - 2


@pytest.mark.parametrize("seq_len, cp", [(65536, 4), (4096, 1)])
def test_memory_floors_are_below_every_attempts_memory(seq_len, cp):
    """P6's and P8's memory floors (model states with ZeRO-2/3's whole buffers, the activations alive before a
    rank's first backward with tensor parallelism's split by role and context parallelism's gathered keys and
    values) never exceed what the estimate of any attempt the search may make holds: plain, selective, full
    recompute (on every stage, or on P6's with selective on the rest), SP's shards. A floor above one prunes a plan
    that fits. Every kind of point is sampled: one stage and pipelines, those P1 and P8 dropped too."""
    from cost_models.cost.context_parallel import cp_view
    from cost_models.cost.estimate import activation_scale, estimate
    from cost_models.cost.memory import overhead_bytes
    from planner import search as S
    prof, c = _llama8b(seq_len), preset("dgx-h100", nodes=2)
    req = PlanRequest(global_batch_size=16, micro_batch_sizes=(1,), max_v=2, cp_degrees=(cp,))
    run = S._as_run(req, c)
    d = S._prepare(prof if cp == 1 else cp_view(prof, cp), c, req, req.resolved_gpus(c), cp)
    overhead = overhead_bytes(c)
    checked = {1: 0, 2: 0}
    for pt in d.points[::max(1, len(d.points) // 60)]:
        ranks = d.bounds.ranks[S._shape(pt)]
        states = S._rank_states(pt, ranks, run)
        scale = activation_scale(d.profile, micro_batch_size=pt.micro_batch_size, precision=run.precision)
        need = S._least_need(pt, states, d.parts, scale)
        alive = float((states + ranks.alive * scale).max())   # P6's, with selective recompute
        stages = d.parts.stages(pt.pp * pt.v)
        must = S._must_recompute(pt, ranks, states, scale, c.device.memory_bytes - overhead)
        every = [dict(), dict(selective=True), dict(recompute=(True,) * len(stages)),
                 dict(recompute=tuple(i in must for i in range(len(stages))), selective=True)]
        every += [dict(shard=True), dict(selective=True, shard=True)] if S._may_save_shards(pt) else []
        held = []
        for kw in every:
            s = S._strategy(pt, stages, precision=req.precision, optimizer=req.optimizer, **kw)
            held.append(estimate(s, d.profile, c).peak_memory_bytes - overhead)
        assert need <= min(held) * (1 + 1e-9), (pt, need, held)
        assert alive <= min(held[1:2] + held[4:]) * (1 + 1e-9), (pt, alive, held)
        checked[min(pt.pp * pt.v, 2)] += 1
    assert checked[1] > 5 and checked[2] > 10, checked
