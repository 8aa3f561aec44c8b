"""The local cluster probe for real: gloo ranks started by torchrun's launcher, measured and fitted."""
import math
import statistics

import pytest

from cost_models.profiling.cluster_probe import ProbeConfig, build_cluster_profile, expected_seconds, run_local_probe
from cost_models.records.fit import fit_alpha_beta

SIZES = tuple(64 * 1024 * 2**i for i in range(9))      # 64 KiB .. 16 MiB
HELD_OUT = {256 * 1024, 2 * 2**20, 8 * 2**20}


def test_fit_recovers_a_known_line():
    sizes = [1e3, 1e4, 1e5, 1e6, 1e7]
    alpha, beta, r2 = fit_alpha_beta(sizes, [2e-4 + 5e-10 * s for s in sizes])
    assert alpha == pytest.approx(2e-4) and beta == pytest.approx(5e-10) and r2 == pytest.approx(1.0)


def test_expected_time_keeps_the_tail_and_drops_one_burst():
    # a heavy tail (a quarter of the calls wait a time slice) is what a step pays on average: kept in the mean
    tail = [0.3e-3] * 9 + [3.5e-3] * 3
    assert expected_seconds(tail) == pytest.approx((9 * 0.3e-3 + 2 * 3.5e-3) / 11)
    assert expected_seconds(tail) > 2.5 * statistics.median(tail)
    # one burst from another process is not the op's cost: the slowest repeat is left out
    assert expected_seconds([1e-3] * 11 + [90e-3]) == pytest.approx(1e-3)
    # too few repeats to tell a burst from the tail: the plain mean
    assert expected_seconds([1e-3, 2e-3, 6e-3]) == pytest.approx(3e-3)


def test_a_run_of_back_to_back_calls_is_costed_on_the_medians():
    from cost_models.records.cluster import CollectiveFit, Sample
    sizes = [4096, 65536, 1048576]
    median = [2e-4 + 1e-9 * s for s in sizes]
    samples = tuple(Sample(size_bytes=s, seconds=3 * m, median_s=m) for s, m in zip(sizes, median))
    fit = CollectiveFit(op="all_reduce", group_size=2, scope="intra", alpha_s=6e-4, beta_s_per_byte=3e-9, r2=1.0,
                        samples=samples)
    assert fit.predict(1e5) == pytest.approx(6e-4 + 3e-4)                     # one call: the expected time
    assert fit.predict(1e5, back_to_back=True) == pytest.approx(2e-4 + 1e-4)  # in a run: the medians' line
    older = CollectiveFit(op="all_reduce", group_size=2, scope="intra", alpha_s=6e-4, beta_s_per_byte=3e-9, r2=1.0,
                          samples=tuple(Sample(size_bytes=s, seconds=m) for s, m in zip(sizes, median)))
    assert older.predict(1e5, back_to_back=True) == older.predict(1e5)     # no medians recorded: one line


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, 4])
def test_probe_fits_predict_held_out_sizes(ranks):
    raw = run_local_probe(ranks, ProbeConfig(sizes=SIZES, repeats=5, matmul_seconds=0.2))
    prof = build_cluster_profile(raw, topology=None, notes=[], dtype="fp32")
    groups = [2, 4] if ranks == 4 else [2]
    assert {(f.op, f.group_size) for f in prof.fits} == (
        {(op, g) for op in ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all") for g in groups}
        | {("send_recv", 2)})
    errors = []
    for f in prof.fits:
        # R^2 of unweighted times after a 1/t^2-weighted fit can fall below 0 on a noisy machine (validate: SIGNED)
        assert math.isfinite(f.r2) and f.r2 <= 1.0 and len(f.samples) == len(SIZES)
        assert all(s.median_s is not None and s.spread_s >= 0 for s in f.samples)
        train = [s for s in f.samples if s.size_bytes not in HELD_OUT]
        alpha, beta, r2 = fit_alpha_beta([s.size_bytes for s in train], [s.median_s for s in train])
        for s in f.samples:
            if s.size_bytes in HELD_OUT:
                errors.append(abs(alpha + beta * s.size_bytes - s.median_s) / s.median_s)
        print(f"{f.op:>15} n={f.group_size} R^2={f.r2:.3f} alpha={f.alpha_s * 1e3:.3f} ms "
              f"bw={1 / f.beta_s_per_byte / 1e9:.3f} GB/s")
    print(f"held-out relative error: median {statistics.median(errors):.1%}, max {max(errors):.1%}")
    # The 2 shared cores make single points noisy; a fit of the medians must still predict unseen sizes to within
    # 50% (a wrong byte count or beta unit is off by 100% or more)
    assert statistics.median(errors) <= 0.50
    assert prof.world_size == ranks and prof.device.kind == "cpu" and prof.intra_node.kind == "gloo-loopback"
    assert prof.compute.ranks == ranks and prof.compute.flops_per_rank > 0 and prof.compute.threads_per_rank == 1
    # a rank's baseline, measured before any probe buffer: torch and gloo mapped, ~224 MiB here (test_memory_model)
    assert 100 * 2**20 < prof.compute.rank_rss_bytes < 1024 * 2**20, prof.compute.rank_rss_bytes / 2**20
    # per-action costs of torch's single-stage schedules and of its multi-stage runtime (with and without a split
    # backward): measured, so non-negative and well under a step (a broken subtraction shows as negative or huge)
    for cost in (prof.compute.pipeline_action_s, prof.compute.pipeline_runtime_action_s,
                 prof.compute.pipeline_split_action_s):
        assert 0.0 <= cost < 0.05
    # the same three with one pipeline over all ranks: the other shape plans run, probed where it differs from pairs
    one = (prof.compute.pipeline_action_one_s, prof.compute.pipeline_runtime_action_one_s,
           prof.compute.pipeline_split_action_one_s)
    assert all(0.0 <= cost < 0.05 for cost in one) and (any(one) if ranks > 2 else one == (0.0, 0.0, 0.0))
    assert prof.device.peak_flops["fp32"] == prof.compute.flops_per_rank
    # copy bandwidth alone and with every rank copying (sharing.memory_contention), in the same unit: one rank alone
    # gets about what one rank gets among them, up to all of them together (2 ranks here: 46 GB/s alone, 24 each)
    assert 0.5 * prof.compute.copy_Bps < prof.compute.copy_alone_Bps < 2 * ranks * prof.compute.copy_Bps
    assert any("share" in n for n in prof.notes)


@pytest.mark.slow
def test_one_rank_probes_compute_and_prices_no_link_it_could_not_measure():
    """A one-GPU machine has no peer: its probe keeps the compute and per-call figures, names its link as not
    measured, and a plan for that one device runs without communication."""
    from cost_models.cost.estimate import estimate
    from cost_models.records.presets import PCIE4
    from cost_models.records.strategy import Strategy
    raw = run_local_probe(1, ProbeConfig(sizes=SIZES[:3], repeats=3, matmul_seconds=0.2))
    assert raw["world"] == 1 and raw["raw"] == []
    prof = build_cluster_profile(raw, topology=None, notes=[], dtype="fp32")
    assert prof.world_size == 1 and prof.fits == () and prof.compute.flops_per_rank > 0
    assert prof.intra_node.bandwidth_Bps == PCIE4.bandwidth_Bps and prof.intra_node.source.startswith("not measured")
    assert any("no collective or link to measure" in n for n in prof.notes)
    from cost_models.models.source import resolve
    from cost_models.profiling.model_profiler import profile_model
    meta = profile_model(resolve("gpt-tiny"), micro_batch_size=2, seq_len=16, meta=True, dtype="fp32")
    est = estimate(Strategy(dp=1, pp=1, zero=0, schedule="1f1b", microbatches=1, micro_batch_size=2,
                            stages=(tuple(u.name for u in meta.units),), precision="fp32"), meta, prof)
    assert est.comm.dp_bytes_per_rank == 0 and est.step_time_s > 0

