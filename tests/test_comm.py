"""Alpha-beta collective costs: the ring formulas exactly, hierarchical across nodes, probed fits preferred."""
import dataclasses

import pytest

from cost_models.cost.comm import (OVERLAP_SLOWDOWN, collective_time, dp_wire_bytes, overlapped_exposure, p2p_time,
                                   ring_phase, tree_all_reduce_time, wire_bytes)
from cost_models.records.cluster import CollectiveFit
from cost_models.records.presets import RING_STEP_LATENCY_S, preset


def test_ring_formulas_inside_one_node():
    c = preset("dgx-h100")
    link, S = c.intra_node, 1e9
    # 7 ring steps: the first in alpha, 6 more at NCCL's per-step NVLink latency
    ag = link.alpha_s + 6 * RING_STEP_LATENCY_S["nvlink4"] + 7 / 8 * S / link.bandwidth_Bps
    assert collective_time(c, "all_gather", S, 8) == pytest.approx(ag)
    assert collective_time(c, "reduce_scatter", S, 8) == pytest.approx(ag)
    assert collective_time(c, "all_reduce", S, 8) == pytest.approx(2 * ag)
    assert collective_time(c, "all_gather", S, 1) == 0.0
    assert p2p_time(c, S, crosses_nodes=False) == pytest.approx(link.alpha_s + S / link.bandwidth_Bps)
    assert p2p_time(c, S, crosses_nodes=True) == pytest.approx(c.inter_node.alpha_s + S / c.inter_node.bandwidth_Bps)


def test_group_spanning_nodes_is_hierarchical():
    c = preset("dgx-h100", nodes=4)
    S = 4e9
    # 32 ranks = 4 nodes x 8: each rail all-gathers S/8 across 4 nodes, then 8 ranks all-gather S in the node.
    # Latency as NCCL's flat ring: 3 network steps and 28 NVLink ones, 7 of them in the intra phase.
    expected = (ring_phase(c.inter_node, S / 8, 4) + ring_phase(c.intra_node, S, 8)
                + 3 * 7 * RING_STEP_LATENCY_S["nvlink4"])
    assert collective_time(c, "all_gather", S, 32) == pytest.approx(expected)
    # Slower than the same group would be if NVLink spanned it all, faster than a flat ring over the NICs.
    assert ring_phase(c.intra_node, S, 32) < expected < ring_phase(c.inter_node, S, 32)
    # the all-reduce: NCCL's tree across nodes (tree_all_reduce_time) where it beats reduce-scatter + all-gather
    ring = 2 * expected
    tree = tree_all_reduce_time(c, S, 8, 4)
    assert collective_time(c, "all_reduce", S, 32) == pytest.approx(min(ring, tree)) and tree < ring
    # its bandwidth term is each NIC's 2 S/8 here, the same at any node count: only latency grows, by log2 k
    far = tree_all_reduce_time(preset("dgx-h100", nodes=64), S, 8, 64)
    assert far - tree == pytest.approx(2 * (6 - 2) * RING_STEP_LATENCY_S["infiniband-ndr"])
    # gloo has no tree: the same layout on CPU ranks stays reduce-scatter + all-gather
    cpu = dataclasses.replace(c, device=dataclasses.replace(c.device, kind="cpu"))
    assert collective_time(cpu, "all_reduce", S, 32) == pytest.approx(ring)


def _busbw(cluster, op: str, size: float, n: int) -> float:
    """nccl-tests' bus bandwidth (doc/PERFORMANCE.md): size / time x (n-1)/n, x 2 for an all-reduce."""
    return size / collective_time(cluster, op, size, n) * (n - 1) / n * (2 if op == "all_reduce" else 1)


@pytest.mark.parametrize("name, nodes, op, size, published", [
    ("dgx-h100", 32, "all_gather", 2**31, 200e9),    # github.com/NVIDIA/nccl/issues/1218
    ("dgx-h100", 32, "all_reduce", 2**31, 340e9),    # the same issue, all_reduce_perf
    ("dgx-h100", 248, "all_reduce", 2**29, 350e9),   # github.com/NVIDIA/nccl-tests/issues/283 (H200 nodes, same NICs)
    ("dgx-a100", 4, "all_reduce", 2**30, 192e9),     # github.com/NVIDIA/nccl/issues/812 (8 x 200 Gb/s HDR)
    ("dgx-h100", 1, "all_reduce", 2**31, 370e9),     # github.com/NVIDIA/nccl-tests/issues/212 (NVLink, one node)
])
def test_bus_bandwidth_at_scale_matches_published_nccl_tests(name, nodes, op, size, published):
    """The presets' collectives against nccl-tests figures published for DGX clusters (presets' module doc): within
    12%. Before the tree all-reduce (and with InfiniBand at 0.8 of line rate), 32 DGX H100 nodes were predicted at
    166 GB/s against ~340 published."""
    assert _busbw(preset(name, nodes=nodes), op, size, nodes * 8) == pytest.approx(published, rel=0.12)


def test_probed_fit_is_used_when_present():
    c = preset("l4-pcie")
    fit = CollectiveFit(op="all_gather", group_size=4, scope="intra", alpha_s=1e-3, beta_s_per_byte=2e-9, r2=0.99)
    c = dataclasses.replace(c, fits=(fit,))
    assert collective_time(c, "all_gather", 1e6, 4) == pytest.approx(1e-3 + 2e-9 * 1e6)
    # no fit for 8 ranks: the link formula
    assert collective_time(c, "all_gather", 1e6, 8) == pytest.approx(ring_phase(c.intra_node, 1e6, 8))


def test_a_broadcast_is_its_probed_fit_or_a_ring_chain_moving_the_whole_buffer():
    """ZeroRedundancyOptimizer's parameter broadcasts: on links, NCCL's ring broadcast (n-1 steps, all S through
    every link: nccl-tests gives it an all-gather's bus bandwidth); where the probe measured broadcasts over this
    group, their fit, however far from an all-gather's (gloo on 4 CPU ranks: 0.5 ms against 3.6)."""
    c, S = preset("dgx-h100"), 1e8
    link = c.intra_node
    assert collective_time(c, "broadcast", S, 8) == pytest.approx(
        link.alpha_s + 6 * RING_STEP_LATENCY_S["nvlink4"] + S / link.bandwidth_Bps)
    assert collective_time(c, "broadcast", S, 1) == 0.0
    two = preset("dgx-h100", nodes=2)   # across nodes: the all-gather's hierarchy on S n/(n-1)
    assert collective_time(two, "broadcast", S, 16) == pytest.approx(collective_time(two, "all_gather", S * 16 / 15, 16))
    bcast = CollectiveFit(op="broadcast", group_size=4, scope="intra", alpha_s=5e-4, beta_s_per_byte=1e-9, r2=0.99)
    gather = CollectiveFit(op="all_gather", group_size=4, scope="intra", alpha_s=3.6e-3, beta_s_per_byte=2e-9, r2=0.99)
    probed = dataclasses.replace(preset("l4-pcie"), fits=(bcast, gather))
    assert collective_time(probed, "broadcast", 1e4, 4) == pytest.approx(5e-4 + 1e-9 * 1e4)
    older = dataclasses.replace(probed, fits=(gather,))   # a cluster file probed before broadcasts were
    assert collective_time(older, "broadcast", 1e4, 4) == pytest.approx(3.6e-3 + 2e-9 * 1e4 * 4 / 3)


def test_ring_latency_grows_with_the_ranks():
    # NCCL's model (tuning.cc): base + (n-1) steps; at a small buffer latency dominates and grows linearly with n
    c = preset("dgx-h100", nodes=256)
    t = {n: collective_time(c, "all_gather", 1e6, n) for n in (64, 256, 1024, 2048)}
    assert t[64] < t[256] < t[1024] < t[2048]
    net, nvl = RING_STEP_LATENCY_S["infiniband-ndr"], RING_STEP_LATENCY_S["nvlink4"]
    # doubling 1024 -> 2048 ranks adds 128 network steps and 896 NVLink steps (the bandwidth term barely moves)
    assert t[2048] - t[1024] == pytest.approx(128 * net + 896 * nvl, rel=0.02)


def test_wire_bytes_are_the_ring_factors_of_the_full_buffer():
    # Patarasuk & Yuan 2009: a ring all-reduce sends 2(n-1)/n of the buffer per rank; all-gather / reduce-scatter
    # (n-1)/n (Thakur et al. 2005). The ZeRO paper's 2 Psi per step (DP, section 7) is the n -> inf limit.
    psi = 1e9
    assert wire_bytes("all_reduce", psi, 8) == pytest.approx(2 * 7 / 8 * psi)
    assert wire_bytes("all_gather", psi, 8) == wire_bytes("reduce_scatter", psi, 8) == pytest.approx(7 / 8 * psi)
    assert wire_bytes("all_reduce", psi, 1) == 0.0
    assert dp_wire_bytes({"all_reduce": psi}, 4096) == pytest.approx(2 * psi, rel=1e-3)
    assert dp_wire_bytes({"all_gather": 2 * psi, "reduce_scatter": psi}, 4096) == pytest.approx(3 * psi, rel=1e-3)


def test_zero3_per_gpu_throughput_falls_at_a_fixed_global_batch(tiny_profiles):
    # Strong scaling of ZeRO-3: per micro-batch a rank's compute stays (micro-batch 1) while each unit's two gathers
    # and one reduce-scatter pay a ring latency that grows with the ranks; past the point where a unit's compute is
    # shorter than its collectives, per-GPU throughput falls with every doubling.
    from cost_models.cost.estimate import estimate
    from cost_models.records.strategy import Strategy
    prof = tiny_profiles["gpt-tiny", True]
    names = tuple(u.name for u in prof.units)
    global_batch, per_gpu, per_mb = 256, {}, {}
    for gpus in (16, 32, 64, 128, 256):
        s = Strategy(dp=gpus, pp=1, zero=3, schedule="1f1b", microbatches=global_batch // gpus, micro_batch_size=1,
                     stages=(names,), precision="bf16-mixed")
        est = estimate(s, prof, preset("dgx-h100", nodes=gpus // 8))
        per_gpu[gpus], per_mb[gpus] = est.tokens_per_s / gpus, est.step_time_s / s.microbatches
    assert all(per_gpu[n] > per_gpu[2 * n] for n in (16, 32, 64, 128))
    # Computed: from k to 2k nodes every exposed collective gains k network steps and k(g-1) NVLink steps (NCCL's
    # flat ring); 3 collectives per unit with parameters, per micro-batch (the bandwidth term barely moves).
    step = RING_STEP_LATENCY_S["infiniband-ndr"] + 7 * RING_STEP_LATENCY_S["nvlink4"]
    collectives = 3 * sum(1 for u in prof.units if u.params)
    for k in (4, 8, 16):
        assert per_mb[16 * k] - per_mb[8 * k] == pytest.approx(collectives * k * step, rel=0.05)


def test_zero1_prices_one_probed_broadcast_per_parameter_tensor(tiny_profiles):
    """ZeroRedundancyOptimizer broadcasts each updated parameter tensor from its owner: ZeRO-1's exposed
    data-parallel time is ZeRO-0's (the DDP all-reduce) plus, per tensor, the broadcast fit's mean at that tensor's
    bytes (the probe timed broadcasts as such a run, so not the medians' line). With all-gather pricing the 4-rank
    plans of benchmarks/fidelity.py were predicted at 1.6-2.6x their measured step."""
    from cost_models.cost.estimate import estimate
    from cost_models.records.cluster import Sample
    from cost_models.records.strategy import Strategy
    from tests.clusters import cpu_cluster
    prof = tiny_profiles["gpt-tiny", True]
    samples = tuple(Sample(size_bytes=b, seconds=4e-4 + 1e-9 * b, median_s=1e-4 + 1e-9 * b) for b in (4096, 65536))
    bcast = CollectiveFit(op="broadcast", group_size=4, scope="intra", alpha_s=4e-4, beta_s_per_byte=1e-9, r2=1.0,
                          samples=samples)
    cpu = cpu_cluster(ranks=4, fits=(bcast,))
    units = tuple(u.name for u in prof.units)
    dp = {z: estimate(Strategy(dp=4, pp=1, zero=z, schedule="1f1b", microbatches=1, micro_batch_size=1,
                               stages=(units,), precision="fp32"), prof, cpu).breakdown.dp_comm_s for z in (0, 1)}
    broadcasts = sum(u.param_tensors * (4e-4 + 1e-9 * 4 * u.params / u.param_tensors)
                     for u in prof.units if u.param_tensors)
    assert dp[1] - dp[0] == pytest.approx(broadcasts)


def test_zero1_on_gpus_broadcasts_each_tensor_after_the_overlapped_all_reduce(tiny_profiles):
    """Without a pipeline on GPUs DDP's all-reduce hides behind the backward; ZeroRedundancyOptimizer's broadcasts
    come after the step, one per tensor, each paying the ring's latency (n-1 steps)."""
    from cost_models.cost.estimate import estimate
    from cost_models.records.strategy import Strategy
    prof, h100 = tiny_profiles["gpt-tiny", True], preset("dgx-h100")
    units = tuple(u.name for u in prof.units)
    dp = {z: estimate(Strategy(dp=8, pp=1, zero=z, schedule="1f1b", microbatches=1, micro_batch_size=1,
                               stages=(units,), precision="fp32"), prof, h100).breakdown.dp_comm_s for z in (0, 1)}
    per_tensor = sum(u.param_tensors * collective_time(h100, "broadcast", 4 * u.params / u.param_tensors, 8)
                     for u in prof.units if u.param_tensors)
    assert dp[1] - dp[0] == pytest.approx(per_tensor)
    # what tells per-tensor pricing from one call of the whole: here the latencies are most of it
    assert per_tensor > 2 * collective_time(h100, "broadcast", 4 * prof.total_params, 8)


def test_a_hidden_collective_still_costs_the_compute_it_slows():
    """Lee et al. 2025: compute beside NCCL runs 18.9% slower. A collective of 1 s beside 10 s of compute slows
    1 / 1.189 s of that compute by 18.9%: 0.159 s; beside 1.1 s it still fits the slowed window (1.189 s > 1 s); one
    longer than the slowed compute exposes the rest whole."""
    assert OVERLAP_SLOWDOWN == pytest.approx(0.189)
    assert overlapped_exposure(1.0, 10.0) == pytest.approx(0.189 / 1.189)
    assert overlapped_exposure(1.0, 1.1) == pytest.approx(0.189 / 1.189)
    assert overlapped_exposure(3.0, 1.0) == pytest.approx(2.0)
    assert overlapped_exposure(0.0, 1.0) == 0.0
    # continuous where the two cases meet: comm = compute x (1 + s)
    assert overlapped_exposure(1.189, 1.0) == pytest.approx(0.189)
