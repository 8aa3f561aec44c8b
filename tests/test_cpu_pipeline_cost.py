"""What a pipeline pays on CPU ranks that share cores: messages that wait for a core (sharing.send_delay, measured
by benchmarks/send_delay.py) and a per-action overhead that depends on how many pipelines run at once (probed in
two shapes by overhead_probe, interpolated by sharing.action_seconds)."""
import dataclasses

import pytest

from cost_models.cost.estimate import _Context, _stage_pass, action_cost, estimate
from cost_models.cost.sharing import SEND_DELAY_CAP_S, action_seconds, busy_ranks, send_delay
from cost_models.cost.simulator import simulate_schedule
from cost_models.models.source import resolve
from cost_models.profiling.model_profiler import profile_model
from cost_models.records.cluster import Calibration
from cost_models.records.presets import preset
from cost_models.records.strategy import Strategy
from tests.clusters import cpu_cluster


@pytest.fixture(scope="module")
def prof():
    return profile_model(resolve("mlp-deep"), micro_batch_size=2, seq_len=16, meta=True, dtype="fp32")


def _pipeline(prof, *, pp: int, dp: int = 1, m: int, schedule: str = "gpipe") -> Strategy:
    names = tuple(u.name for u in prof.units)
    cut = [round(i * len(names) / pp) for i in range(pp + 1)]
    return Strategy(dp=dp, pp=pp, zero=0, schedule=schedule, microbatches=m, micro_batch_size=2, v=1,
                    stages=tuple(names[cut[i]:cut[i + 1]] for i in range(pp)), precision="fp32")


def test_sends_wait_for_a_core_for_the_share_of_the_step_every_core_is_busy(prof):
    """4 ranks on 2 cores: a 4-stage pipeline of one micro-batch computes on one rank at a time (busy_ranks 1), so
    its sends leave at once; with 8 micro-batches 2.9 ranks compute at once and sends may wait SEND_DELAY_CAP_S.
    2 ranks on 2 cores: one micro-batch, none; 8, both ranks compute 16/9 - 1 of the step, so 7/9 of the cap. GPUs
    never wait."""
    four = cpu_cluster(ranks=4, cores=2)
    one_mb, eight_mb = _pipeline(prof, pp=4, m=1), _pipeline(prof, pp=4, m=8)
    assert busy_ranks(one_mb) == pytest.approx(1.0) and busy_ranks(eight_mb) == pytest.approx(32 / 11)
    assert send_delay(one_mb, four) == 0.0 and send_delay(eight_mb, four) == SEND_DELAY_CAP_S
    assert send_delay(_pipeline(prof, pp=2, dp=2, m=4), four) == SEND_DELAY_CAP_S
    two = cpu_cluster(ranks=2, cores=2)
    assert send_delay(_pipeline(prof, pp=2, m=1), two) == 0.0
    assert send_delay(_pipeline(prof, pp=2, m=8), two) == pytest.approx(7 / 9 * SEND_DELAY_CAP_S)
    assert send_delay(eight_mb, preset("dgx-a100")) == 0.0
    # the estimate's step is that delayed simulation of its stages (plus the optimizer: no dp, no tie here)
    est = estimate(eight_mb, prof, four)
    costs = tuple(st.cost() for st in est.stages)
    delayed = simulate_schedule("gpipe", 4, 8, 1, costs, send_delay_s=SEND_DELAY_CAP_S)
    at_once = simulate_schedule("gpipe", 4, 8, 1, costs)
    assert delayed.makespan_s > at_once.makespan_s
    assert est.step_time_s == pytest.approx(delayed.makespan_s + est.breakdown.optimizer_s)


def test_per_action_cost_follows_the_pipelines_running_at_once(prof):
    """The probe measured every pair at once (ranks // 2 pipelines) and one pipeline over all ranks; a plan is
    interpolated linearly in its dp x tp pipelines between them, each schedule kind from its own pair of values."""
    base = cpu_cluster(ranks=8, cores=2)
    probe = dataclasses.replace(base.compute, pipeline_action_s=4e-4, pipeline_action_one_s=1e-4,
                                pipeline_split_action_s=1e-3, pipeline_split_action_one_s=4e-4)
    single = dict(multi_stage=False, split_backward=False)
    assert action_seconds(probe, pipelines_at_once=1, **single) == pytest.approx(1e-4)
    assert action_seconds(probe, pipelines_at_once=2, **single) == pytest.approx(2e-4)   # 1/3 of the way to 4
    assert action_seconds(probe, pipelines_at_once=4, **single) == pytest.approx(4e-4)
    assert action_seconds(probe, pipelines_at_once=16, **single) == pytest.approx(4e-4)   # beyond the probe: pairs
    split = dict(multi_stage=True, split_backward=True)
    assert action_seconds(probe, pipelines_at_once=1, **split) == pytest.approx(4e-4)
    assert action_seconds(probe, pipelines_at_once=3, **split) == pytest.approx(8e-4)
    # the runtime kind was not probed (an older file): it costs as the single-stage classes, in both shapes
    runtime = dict(multi_stage=True, split_backward=False)
    assert action_seconds(probe, pipelines_at_once=1, **runtime) == pytest.approx(1e-4)
    # one shape only (2 ranks, or an older file): the pairs' value whatever the plan
    assert action_seconds(dataclasses.replace(probe, pipeline_action_one_s=0.0), pipelines_at_once=1,
                          **single) == pytest.approx(4e-4)
    # 3 ranks: pairs run one at a time, so one pipeline (the other shape probed) is what a PP3 plan pays
    three = dataclasses.replace(probe, ranks=3)
    assert action_seconds(three, pipelines_at_once=1, **single) == pytest.approx(1e-4)
    # the estimate charges the plan's shape per action: PP8 one pipeline, PP2 x DP4 four
    cluster = dataclasses.replace(base, compute=probe)
    assert action_cost(_pipeline(prof, pp=8, m=8), cluster) == pytest.approx(1e-4)
    assert action_cost(_pipeline(prof, pp=2, dp=4, m=8), cluster) == pytest.approx(4e-4)
    # (the stages as priced, before the sharing of cores over the step stretches them: tests/test_sharing.py)
    lone, pairs = (_stage_pass(_Context.of(s, prof, cluster))[0]
                   for s in (_pipeline(prof, pp=2, m=8), _pipeline(prof, pp=2, dp=4, m=8)))
    assert all(b.fwd_s - a.fwd_s == pytest.approx(3e-4) for a, b in zip(lone, pairs))
    # a calibrated value is what runs showed: it replaces every kind and shape
    cal = dataclasses.replace(cluster, calibration=Calibration(pipeline_action_s=7e-4))
    assert action_cost(_pipeline(prof, pp=8, m=8), cal) == action_cost(_pipeline(prof, pp=2, dp=4, m=8), cal) == 7e-4


def test_other_programs_runnable_beside_the_probe_share_the_cores():
    """Processor sharing with b other runnable tasks: each of k busy ranks gets cores / (k + b). A probe of 4 ranks
    on 2 cores beside 2 busy programs measured each rank at a third of its alone rate (both shared): 2 cores (capped
    by the host's), and 4 busy ranks then compute 3x slower than alone, not 2x; without background, as before."""
    from cost_models.cost.sharing import contention, effective_cores
    from cost_models.records.cluster import ComputeProbe
    from cost_models.torch_compat.host import runnable_tasks
    probe = ComputeProbe(dtype="fp32", matmul_n=512, ranks=4, threads_per_rank=1, flops_per_rank=1e9,
                         flops_alone=2e9, host_cores=2)
    cluster = dataclasses.replace(preset("dgx-a100"), compute=probe,
                                  device=dataclasses.replace(preset("dgx-a100").device, kind="cpu"))
    assert (effective_cores(cluster, 4), contention(cluster, 4), contention(cluster, 1)) == (2.0, 2.0, 1.0)
    # a probe whose ranks read above the host's cores (their windows timed one by one): the host's cores
    above = dataclasses.replace(cluster, compute=dataclasses.replace(probe, flops_per_rank=1.03e9))
    assert effective_cores(above, 4) == 2.0 and contention(above, 4) == 2.0
    unknown = dataclasses.replace(cluster, compute=dataclasses.replace(probe, flops_per_rank=1.03e9, host_cores=0))
    assert effective_cores(unknown, 4) == pytest.approx(2.06)
    loaded = dataclasses.replace(cluster, compute=dataclasses.replace(probe, background_runnable=2.0))
    assert effective_cores(loaded, 4) == pytest.approx(2 * 4 / 6)
    assert contention(loaded, 4) == pytest.approx(3.0) and contention(loaded, 1) == pytest.approx(1.5)
    assert runnable_tasks("3.95 4.10 2.00 5/612 90210\n") == 5 and runnable_tasks("garbage") is None


def test_profiles_time_one_cpu_thread_by_its_cpu_time_and_the_probe_prices_the_load_that_lasted():
    """host.work_clock: one torch thread on CPU is timed by the thread's CPU time, which does not advance while the
    thread waits (here: sleeps; under load: waits for a core), so other programs' tasks do not enter the unit times;
    wall time with more threads or on a GPU. The probe counts other programs' tasks before and after its ranks and
    prices the lesser, saying so when they differ."""
    import time

    from cost_models.profiling.cluster_probe import _cpu_notes
    from cost_models.records.cluster import ComputeProbe
    from cost_models.torch_compat.host import work_clock, work_clock_name
    cpu_clock = work_clock(on_cpu=True, threads=1)
    assert cpu_clock is time.thread_time and work_clock(on_cpu=True, threads=2) is time.perf_counter
    assert work_clock(on_cpu=False, threads=1) is time.perf_counter
    assert [work_clock_name(on_cpu=c, threads=t) for c, t in ((True, 1), (True, 4), (False, 1))] == [
        "thread-cpu", "wall", "wall"]
    t0, w0 = cpu_clock(), time.perf_counter()
    time.sleep(0.3)
    assert time.perf_counter() - w0 >= 0.3 and cpu_clock() - t0 < 0.15
    probe = ComputeProbe(dtype="fp32", matmul_n=512, ranks=4, threads_per_rank=1, flops_per_rank=1e9,
                         flops_alone=2e9, host_cores=2, background_runnable=2.0)
    notes = _cpu_notes(probe, 4, 2**30, seen=(4.0, 2.0))
    assert notes[-1] == ("other programs' runnable tasks changed during the probe (4 before, 2 after): the 2 that "
                         "lasted are priced")
    assert not any("changed" in n for n in _cpu_notes(probe, 4, 2**30, seen=(2.0, 2.0)))
