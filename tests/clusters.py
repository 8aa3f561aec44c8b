"""A CPU cluster as the probe would describe it, for cost-model tests (no probe run: its figures are set here)."""
from cost_models.records.cluster import ClusterProfile, CollectiveFit, ComputeProbe, DeviceSpec, LinkSpec


def cpu_cluster(*, ranks: int, threads: int = 1, cores: int | None = None,
                fits: tuple[CollectiveFit, ...] = ()) -> ClusterProfile:
    """`ranks` CPU ranks of `threads` threads on one node; with `cores`, a compute probe of them sharing that many
    cores (1e10 FLOP/s alone, ranks / cores slower each when they outnumber the cores); `fits`: probed collectives
    (the 1 GB/s, 0.1 ms loopback link prices the rest)."""
    compute = None if cores is None else ComputeProbe(
        dtype="fp32", matmul_n=8, ranks=ranks, threads_per_rank=threads,
        flops_per_rank=1e10 * min(1.0, cores / ranks), flops_alone=1e10)
    return ClusterProfile(name="cpu", source="test", nodes=1, devices_per_node=ranks, fits=fits, compute=compute,
                          device=DeviceSpec(name="cpu", kind="cpu", memory_bytes=2**34, peak_flops={"fp32": 1e10},
                                            matmul_efficiency=1.0, source="test"),
                          intra_node=LinkSpec(kind="loop", bandwidth_Bps=1e9, alpha_s=1e-4, source="test"))
