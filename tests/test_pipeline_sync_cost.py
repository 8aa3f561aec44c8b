"""What a pipeline's ranks wait for besides their stages: the FSDP gathers of ZeRO-2/3 stages (inside the schedule)
and the all-reduce of tied gradients across pipeline ranks (after it). The counts and bytes are checked against the
executor's CommCounter in tests/test_executor.py; here, the prices."""
import dataclasses

import pytest

from cost_models.cost.comm import collective_time
from cost_models.cost.estimate import estimate
from cost_models.cost.simulator import simulate_schedule
from cost_models.models.source import resolve
from cost_models.profiling.model_profiler import profile_model
from cost_models.records.cluster import CollectiveFit
from cost_models.records.precision import BYTES_PER_PARAM
from cost_models.records.presets import preset
from cost_models.records.strategy import Strategy


def _profile(model: str):
    return profile_model(resolve(model), micro_batch_size=2, seq_len=16, meta=True, dtype="fp32")


def _pp2(prof, *, dp: int = 1, zero: int = 0, schedule: str = "gpipe", m: int = 2, v: int = 1) -> Strategy:
    names = tuple(u.name for u in prof.units)
    n = 2 * v
    cut = [round(i * len(names) / n) for i in range(n + 1)]
    return Strategy(dp=dp, pp=2, zero=zero, schedule=schedule, microbatches=m, micro_batch_size=2, v=v,
                    stages=tuple(names[cut[i]:cut[i + 1]] for i in range(n)), precision="fp32")


def test_a_pipelines_fsdp_gathers_sit_in_its_schedule():
    """ZeRO-2 gathers each stage once, before micro-batch 0's forward; ZeRO-3 before every forward and micro-batch
    0's backward (m + 1 per step, as counted); both at the dp group's all-gather price of the stage's parameters.
    The reduce-scatter stays after the pipeline. torch's schedule runtime prefetches them instead (none inside)."""
    prof, cluster = _profile("gpt-tiny"), preset("dgx-a100")
    p_b, g_b, _ = BYTES_PER_PARAM[("fp32", "adamw")]
    z0, z2, z3 = (estimate(_pp2(prof, dp=2, zero=z), prof, cluster) for z in (0, 2, 3))
    for a, b, c in zip(z0.stages, z2.stages, z3.stages):
        gather = collective_time(cluster, "all_gather", b.params * p_b, 2)
        assert gather > 0 and a.gather_s == 0.0
        assert b.gather_s == pytest.approx(gather) and not b.gather_every_forward
        assert c.gather_s == pytest.approx(gather) and c.gather_every_forward
        two, three = b.cost(), c.cost()
        assert (two.fwd_s, two.first_fwd_extra_s, two.first_bwd_extra_s) == pytest.approx((a.fwd_s, gather, 0.0))
        assert (three.fwd_s, three.first_fwd_extra_s, three.first_bwd_extra_s) == pytest.approx(
            (a.fwd_s + gather, 0.0, gather))
    # the step: the schedule with the gathers, then the stage's reduce-scatter, the tied sync and the optimizer
    sim = simulate_schedule("gpipe", 2, 2, 1, tuple(st.cost() for st in z2.stages))
    assert sim.makespan_s > simulate_schedule("gpipe", 2, 2, 1, tuple(st.cost() for st in z0.stages)).makespan_s
    first = z2.stages[0]
    reduce = collective_time(cluster, "reduce_scatter", first.params * g_b, 2)
    tied = collective_time(cluster, "all_reduce", prof.shared[0].numel * g_b / 2, 2, alone=True)
    assert z2.step_time_s == pytest.approx(sim.finish_s[0] + reduce + tied + z2.breakdown.optimizer_s)
    # bytes per step on pipeline rank 0, as the executor counts them
    assert z2.comm.dp_collectives == pytest.approx({"all_gather": first.params * p_b, "reduce_scatter": first.params * g_b})
    assert z3.comm.dp_collectives["all_gather"] == pytest.approx(3 * first.params * p_b)
    looped = estimate(_pp2(prof, dp=2, zero=2, schedule="interleaved-1f1b", m=2, v=2), prof, cluster)
    assert all(st.gather_s == 0.0 for st in looped.stages)


def test_tied_gradients_are_all_reduced_across_the_pipeline_ranks_holding_them():
    """gpt-tiny's embedding is its head's weight: with the two on different pipeline ranks the executor all-reduces
    the gradient (a ZeRO-2/3 shard of it) over those ranks after the step's syncs. llama-tiny ties nothing."""
    cluster = preset("dgx-a100")
    g_b = BYTES_PER_PARAM[("fp32", "adamw")][1]
    gpt, llama = _profile("gpt-tiny"), _profile("llama-tiny")
    numel = gpt.shared[0].numel
    plain = estimate(_pp2(gpt), gpt, cluster)
    tied = collective_time(cluster, "all_reduce", numel * g_b, 2, alone=True)
    assert tied > 0
    # rank 0 (the embedding's stage) ends the pipeline last, so the call starts when its backward does
    assert plain.breakdown.dp_comm_s == pytest.approx(tied)
    assert plain.comm.tied_bytes_per_rank == numel * g_b
    sharded = estimate(_pp2(gpt, dp=2, zero=3), gpt, cluster)
    assert sharded.comm.tied_bytes_per_rank == numel * g_b / 2
    untied = estimate(_pp2(llama), llama, cluster)
    assert untied.breakdown.dp_comm_s == 0.0 and untied.comm.tied_bytes_per_rank == 0.0
    # one stage holds both ends (a single rank): nothing to sync
    one = Strategy(dp=2, pp=1, zero=0, schedule="gpipe", microbatches=2, micro_batch_size=2,
                   stages=(tuple(u.name for u in gpt.units),), precision="fp32")
    assert estimate(one, gpt, cluster).comm.tied_bytes_per_rank == 0.0


def test_a_lone_all_reduce_is_priced_by_the_probes_all_reduce_fit():
    """The tied sync runs alone, as the probe times all-reduces; the data-parallel ones keep reduce-scatter +
    all-gather (comm.collective_time: which fits which, measured)."""
    fits = (CollectiveFit(op="all_reduce", group_size=2, scope="intra", alpha_s=1.3e-3, beta_s_per_byte=0.7e-9, r2=0.98),
            CollectiveFit(op="reduce_scatter", group_size=2, scope="intra", alpha_s=1.0e-3, beta_s_per_byte=0.9e-9,
                          r2=0.95),
            CollectiveFit(op="all_gather", group_size=2, scope="intra", alpha_s=0.4e-3, beta_s_per_byte=0.5e-9, r2=0.8))
    c = dataclasses.replace(preset("l4-pcie"), fits=fits)
    size = 4.2e6
    assert collective_time(c, "all_reduce", size, 2, alone=True) == pytest.approx(1.3e-3 + 0.7e-9 * size)
    assert collective_time(c, "all_reduce", size, 2) == pytest.approx(1.0e-3 + 0.9e-9 * size + 0.4e-3 + 0.5e-9 * size)
    # no all-reduce fit for the group: the ring either way
    older = dataclasses.replace(c, fits=fits[1:])
    assert collective_time(older, "all_reduce", size, 2, alone=True) == collective_time(older, "all_reduce", size, 2)
