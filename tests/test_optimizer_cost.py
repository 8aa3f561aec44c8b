"""The optimizer step's price: timed in a real profile (cold caches, warm allocator), slowed by ranks updating at
once as the probe's copy bandwidth says, and the bandwidth formula where no timing applies."""
import dataclasses

import pytest
import torch

from cost_models.cost.compute import optimizer_step_time
from cost_models.cost.estimate import estimate
from cost_models.cost.sharing import busy_ranks, contention, memory_contention
from cost_models.records.presets import preset
from cost_models.records.profile import Timing
from cost_models.records.strategy import Strategy
from cost_models.torch_compat.optimizers import OPTIMIZERS, build, time_optimizers
from tests.clusters import cpu_cluster


def _data_parallel(prof, *, optimizer: str = "adamw") -> Strategy:
    """ZeRO-0 over 2 ranks, one micro-batch of 2, fp32: every rank updates the whole model."""
    return Strategy(dp=2, pp=1, zero=0, schedule="1f1b", microbatches=1, micro_batch_size=2, precision="fp32",
                    optimizer=optimizer, stages=(tuple(u.name for u in prof.units),))


def _with_copies(cluster, *, alone: float, together: float):
    return dataclasses.replace(cluster, compute=dataclasses.replace(cluster.compute, copy_alone_Bps=alone,
                                                                    copy_Bps=together))


def test_a_real_profile_times_every_optimizer_on_the_whole_small_model(tiny_profiles):
    prof = tiny_profiles["gpt-tiny", False]
    assert [t.optimizer for t in prof.optimizer_timings] == list(OPTIMIZERS)
    tensors = sum(u.param_tensors for u in prof.units)
    for t in prof.optimizer_timings:
        assert t.params == prof.total_params and t.tensors == tensors
        assert t.step.min_s <= t.step.median_s <= t.step.max_s and t.step.repeats == 3
        assert t.tensor_s > 0   # timed; how it compares with the step is a timing, which load can reorder
        # the step beyond its per-tensor part, per parameter; none where load made the tensors' part the larger
        assert t.param_seconds() == pytest.approx(max(0.0, t.step.median_s - t.tensors * t.tensor_s) / t.params)
    assert tiny_profiles["gpt-tiny", True].optimizer_timings == ()   # meta: nothing timed


def test_the_timing_takes_at_most_its_cap_of_parameters_in_order():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))   # tensors of 4096, 64, 4096, 64
    (adamw, *_) = time_optimizers(model, torch.device("cpu"), warmup=1, repeats=2, max_params=4096 + 64 + 100)
    assert (adamw.params, adamw.tensors) == (4096 + 64, 2)
    (adamw, *_) = time_optimizers(model, torch.device("cpu"), warmup=1, repeats=2, max_params=10)
    assert (adamw.params, adamw.tensors) == (4096, 1)   # at least one tensor


def test_the_executor_builds_the_optimizer_the_profile_timed(tiny_profiles):
    from executor.train import optimizer_for
    prof = tiny_profiles["gpt-tiny", False]
    p = [torch.nn.Parameter(torch.zeros(2))]
    for name, cls in (("adamw", torch.optim.AdamW), ("adam", torch.optim.Adam), ("sgd", torch.optim.SGD)):
        made = optimizer_for(_data_parallel(prof, optimizer=name), 0.1)(p)
        assert type(made) is cls and type(build(name, p, 0.1)) is cls
    assert optimizer_for(_data_parallel(prof, optimizer="sgd"), 0.1)(p).defaults["momentum"] == 0.9


def test_memory_contention_runs_from_one_rank_to_the_probes_copy_ratio():
    c = _with_copies(cpu_cluster(ranks=4, cores=4), alone=40e9, together=10e9)   # 4x slower with all four copying
    assert memory_contention(c, 1) == pytest.approx(1.0)
    assert memory_contention(c, 4) == pytest.approx(4.0)
    assert memory_contention(c, 2.5) == pytest.approx(1 + 3 * 0.5)
    # never below the cores' contention: 4 ranks on 2 cores, copies no slower than compute
    shared = _with_copies(cpu_cluster(ranks=4, cores=2), alone=10e9, together=9e9)
    assert memory_contention(shared, 4) == pytest.approx(contention(shared, 4)) == pytest.approx(2.0)
    # a cluster file probed before copy_alone_Bps was: the cores' contention
    old = _with_copies(cpu_cluster(ranks=4, cores=2), alone=0.0, together=9e9)
    assert memory_contention(old, 3) == pytest.approx(contention(old, 3))
    assert memory_contention(preset("dgx-h100"), 8) == 1.0


def test_the_estimate_prices_the_update_from_the_profiles_timing(tiny_profiles):
    prof = tiny_profiles["gpt-tiny", False]
    c = _with_copies(cpu_cluster(ranks=2, threads=prof.threads, cores=2), alone=40e9, together=20e9)
    s = _data_parallel(prof)
    base = estimate(s, prof, c).breakdown.optimizer_s
    # the timing doubled: the update's part doubles, the per-tensor part (the cluster's probe, 0 here) stays
    slow = dataclasses.replace(prof, optimizer_timings=tuple(
        dataclasses.replace(t, step=Timing(median_s=2 * t.step.median_s - t.tensors * t.tensor_s, min_s=0.0,
                                           max_s=1.0, repeats=3)) for t in prof.optimizer_timings))
    t = prof.optimizer_timing("adamw")
    assert estimate(s, slow, c).breakdown.optimizer_s == pytest.approx(2 * base)
    assert base == pytest.approx(prof.total_params * t.param_seconds() * memory_contention(c, busy_ranks(s)))
    assert memory_contention(c, busy_ranks(s)) == pytest.approx(2.0)
    # SGD's own timing, not AdamW's
    sgd = dataclasses.replace(s, optimizer="sgd")
    assert estimate(sgd, prof, c).breakdown.optimizer_s == pytest.approx(
        prof.total_params * prof.optimizer_timing("sgd").param_seconds() * 2.0)
    # a profile from before the timing was recorded: 28 B per parameter at the probe's copy bandwidth
    old = dataclasses.replace(prof, optimizer_timings=())
    assert estimate(s, old, c).breakdown.optimizer_s == pytest.approx(
        prof.total_params * 28 / c.device.memory_bandwidth_Bps if c.device.memory_bandwidth_Bps else 0.0)


def test_a_cpu_profiles_timing_does_not_price_a_gpu_cluster(tiny_profiles):
    prof = tiny_profiles["gpt-tiny", False]
    h100 = preset("dgx-h100")
    got = optimizer_step_time(1e6, profile=prof, cluster=h100, precision="bf16-mixed", optimizer="adamw",
                              ranks_running=8)
    assert got == pytest.approx(1e6 * 30 / h100.device.memory_bandwidth_Bps)
