"""Presets for clusters you do not have: one node each, scaled with `--nodes N`. Every number cites its source.

Bandwidths are per GPU per direction. "Achievable" applies NCCL_EFFICIENCY to the datasheet figure: nccl-tests
on DGX systems report bus bandwidths of roughly 80% of the NVLink / NIC line rate for large messages (NVIDIA
nccl-tests README "Performance" section; DGX H100 all_reduce busbw ~360-480 GB/s against 450 GB/s per direction).
Latency alpha (per collective): NCCL's own tuning model (src/graph/tuning.cc) charges a Ring/Simple collective a
base latency of 8.4 us plus 3.4 us per NVLink hop, so NVLink gets 12 us; PCIe (15 us), InfiniBand (20 us) and
Ethernet (30 us) are assumptions of the same order, stated here and overridable in a cluster file.
Ring step latency (RING_STEP_LATENCY_S): a ring all-gather / reduce-scatter over n ranks takes n-1 steps and NCCL's
cost model charges each step a hardware latency (src/graph/tuning.cc, hwLat, Ring / Simple protocol: NVLink 3.4 us,
PCIe 5.7 us, network 9.6 us; baseLat 8.4 us once per collective), so a ring's latency grows linearly with its ranks
(NCCL maintainers, github.com/NVIDIA/nccl/issues/1712). The alpha above is the two-rank collective (base + one step);
cost_models.cost.comm adds (n-2) steps.
Bus bandwidth at scale, against published nccl-tests figures (tests/test_comm.py checks each within 12%):
all_gather_perf at 2 GB on 32 DGX H100 nodes (256 GPUs) ~200 GB/s busbw and all_reduce_perf ~340 GB/s
(github.com/NVIDIA/nccl/issues/1218), against ~370 GB/s effective NVLink busbw inside a node (NCCL maintainer,
github.com/NVIDIA/nccl-tests/issues/212); all_reduce_perf at 512 MB on 248 H200 nodes (the same 8 x 400 Gb/s NICs
and NVLink 4) ~350 GB/s (github.com/NVIDIA/nccl-tests/issues/283); 192 GB/s across DGX A100 nodes
(github.com/NVIDIA/nccl/issues/812). The all-gather's drop comes from the hierarchical ring (cost_models.cost.comm: the
network phase adds to the NVLink one); the all-reduce holds up because NCCL runs it as a tree across nodes, whose
phases overlap (cost_models.cost.comm.tree_all_reduce_time).
Matmul efficiency (achieved / dense peak) is the maximum achievable matmul FLOPS over a search of bf16 shapes
(stas00/ml-engineering, compute/accelerator/README.md, "Maximum Achievable Matmul FLOPS comparison table"): A100 SXM
271.2 of 312 TFLOP/s (86.9%), A100 PCIe 252.9 (81.1%), H100 SXM 794.5 of 989 (80.3%); parts it does not list get
MATMUL_EFFICIENCY, an assumption. cost_models.cost.kernels takes it down for shapes that waste tiles, over the SMs
(sm_count: A100 108, H100 SXM5 132, L4 58; NVIDIA's A100 and H100 architecture whitepapers, L4 datasheet).
Attention efficiency: the fused kernels' published benchmarks. A100: FlashAttention-2 (Dao 2023, arXiv 2307.08691)
reaches 50-73% of peak, its forward up to 73%; the backward is the slower pass, at the range's low end. H100:
FlashAttention-3 (Shah et al. 2024, arXiv 2407.08608) forward up to 75% of peak in bf16/fp16, its backward 1.5-1.75x
FlashAttention-2's, which reaches 35% on H100: 0.55. Best published figures: short causal sequences run below them.
"""
from __future__ import annotations

from cost_models.records.cluster import ClusterProfile, DeviceSpec, LinkSpec
from cost_models.records.errors import ConfigError

NCCL_EFFICIENCY = 0.8
# InfiniBand NICs reach more of their line rate under NCCL: "For NDR @ 400Gbps you should see 46-48GB/s per NIC"
# (NCCL maintainer, github.com/NVIDIA/nccl-tests/issues/290), and DGX A100's 8 x 200 Gb/s HDR measure 192 GB/s
# all-reduce busbw across nodes (NCCL maintainer, github.com/NVIDIA/nccl/issues/812): 0.92-0.96 of line rate.
NET_EFFICIENCY = 0.92
MATMUL_EFFICIENCY = 0.7   # parts with no published maximum achievable matmul rate (module doc)
A100_SXM_MAMF = 271.2 / 312
A100_PCIE_MAMF = 252.9 / 312
H100_SXM_MAMF = 794.5 / 989
FLASH_ATTENTION_2 = {"fwd": 0.73, "bwd": 0.50}   # A100 (module doc)
FLASH_ATTENTION_3 = {"fwd": 0.75, "bwd": 0.55}   # H100 (module doc)
MIB = 2**20
GB = 1e9


def _link(kind: str, line_rate_Bps: float, alpha_s: float, source: str,
          efficiency: float = NCCL_EFFICIENCY) -> LinkSpec:
    return LinkSpec(kind=kind, bandwidth_Bps=line_rate_Bps * efficiency, alpha_s=alpha_s,
                    source=f"{source}; x{efficiency} achievable (nccl-tests)")


# NVIDIA H100 datasheet (SXM5): 989.4 TFLOP/s dense BF16/FP16 (1,979 with sparsity), 66.9 TFLOP/s FP32;
# nvidia-smi reports 81,559 MiB on an 80 GB part.
H100_SXM = DeviceSpec(name="H100-SXM5-80GB", kind="gpu", memory_bytes=81_559 * MIB,
                      peak_flops={"bf16": 989.4e12, "fp16": 989.4e12, "fp32": 66.9e12},
                      matmul_efficiency=H100_SXM_MAMF, source="NVIDIA H100 Tensor Core GPU datasheet (SXM5)",
                      memory_bandwidth_Bps=3.35e12,  # HBM3, 3.35 TB/s (datasheet)
                      sm_count=132, attention_efficiency=FLASH_ATTENTION_3)
# NVIDIA A100 datasheet: 312 TFLOP/s dense BF16/FP16, 19.5 TFLOP/s FP32 (156 TF32); 80 GB part: 81,920 MiB,
# 40 GB part: 40,960 MiB in nvidia-smi.
A100_SXM_80 = DeviceSpec(name="A100-SXM4-80GB", kind="gpu", memory_bytes=81_920 * MIB,
                         peak_flops={"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
                         matmul_efficiency=A100_SXM_MAMF, source="NVIDIA A100 Tensor Core GPU datasheet",
                         memory_bandwidth_Bps=2.039e12,  # HBM2e, 2,039 GB/s (datasheet, 80 GB SXM)
                         sm_count=108, attention_efficiency=FLASH_ATTENTION_2)
A100_PCIE_40 = DeviceSpec(name="A100-PCIE-40GB", kind="gpu", memory_bytes=40_960 * MIB,
                          peak_flops={"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
                          matmul_efficiency=A100_PCIE_MAMF, source="NVIDIA A100 Tensor Core GPU datasheet (PCIe)",
                          memory_bandwidth_Bps=1.555e12,  # HBM2, 1,555 GB/s (datasheet, 40 GB PCIe)
                          sm_count=108, attention_efficiency=FLASH_ATTENTION_2)
# NVIDIA L4 datasheet: 121 TFLOP/s dense BF16/FP16 (242 with sparsity), 30.3 TFLOP/s FP32, 24 GB
# (nvidia-smi: 23,034 MiB), PCIe Gen4 x16.
L4 = DeviceSpec(name="L4-24GB", kind="gpu", memory_bytes=23_034 * MIB,
                peak_flops={"bf16": 121e12, "fp16": 121e12, "fp32": 30.3e12},
                matmul_efficiency=MATMUL_EFFICIENCY, source="NVIDIA L4 Tensor Core GPU datasheet",
                memory_bandwidth_Bps=300e9,  # GDDR6, 300 GB/s (datasheet)
                sm_count=58)

# NVLink 4 (H100 SXM): 900 GB/s bidirectional per GPU = 450 GB/s per direction, all GPUs through NVSwitch (DGX H100 datasheet).
NVLINK4 = _link("nvlink4", 450 * GB, 12e-6, "DGX H100 datasheet: NVLink 4, 900 GB/s bidirectional per GPU")
# NVLink 3 (A100 SXM): 600 GB/s bidirectional per GPU = 300 GB/s per direction (DGX A100 datasheet).
NVLINK3 = _link("nvlink3", 300 * GB, 12e-6, "DGX A100 datasheet: NVLink 3, 600 GB/s bidirectional per GPU")
# PCIe 4.0 x16: 16 GT/s x 16 lanes, 128b/130b encoding = 31.5 GB/s per direction (PCI-SIG PCIe 4.0 spec).
PCIE4 = _link("pcie4", 31.5 * GB, 15e-6, "PCI-SIG PCIe 4.0: 16 GT/s x16, 31.5 GB/s per direction")
# DGX H100: 8 x ConnectX-7 400 Gb/s InfiniBand, one per GPU = 50 GB/s per GPU per direction.
IB_400 = _link("infiniband-ndr", 400e9 / 8, 20e-6, "DGX H100 datasheet: 8x 400 Gb/s ConnectX-7, one NIC per GPU",
               NET_EFFICIENCY)
# DGX A100: 8 x ConnectX-6 200 Gb/s HDR InfiniBand, one per GPU = 25 GB/s per GPU per direction.
IB_200 = _link("infiniband-hdr", 200e9 / 8, 20e-6, "DGX A100 datasheet: 8x 200 Gb/s ConnectX-6, one NIC per GPU",
               NET_EFFICIENCY)
# 100 Gb/s Ethernet, one NIC per node shared by its 8 GPUs: 12.5 GB/s / 8 per GPU when all communicate at once.
ETH_100_SHARED_8 = _link("ethernet-100g", 100e9 / 8 / 8, 30e-6, "100 Gb/s Ethernet per node, shared by 8 GPUs")

# Per ring step after the first, by link kind (NCCL src/graph/tuning.cc hwLat, Ring / Simple; module doc).
# Kinds not listed (gloo-loopback, unknown) get none: their probed fits stand for the sizes probed.
RING_STEP_LATENCY_S: dict[str, float] = {
    "nvlink3": 3.4e-6, "nvlink4": 3.4e-6, "nvlink": 3.4e-6, "pcie4": 5.7e-6, "pcie": 5.7e-6,
    "infiniband-ndr": 9.6e-6, "infiniband-hdr": 9.6e-6, "infiniband": 9.6e-6, "ethernet-100g": 9.6e-6,
    "network": 9.6e-6,
}

PRESETS: dict[str, ClusterProfile] = {
    p.name: p for p in [
        ClusterProfile(name="dgx-h100", source="preset:dgx-h100", nodes=1, devices_per_node=8, device=H100_SXM,
                       intra_node=NVLINK4, inter_node=IB_400),
        ClusterProfile(name="dgx-a100", source="preset:dgx-a100", nodes=1, devices_per_node=8, device=A100_SXM_80,
                       intra_node=NVLINK3, inter_node=IB_200),
        ClusterProfile(name="a100-pcie-40g", source="preset:a100-pcie-40g", nodes=1, devices_per_node=8,
                       device=A100_PCIE_40, intra_node=PCIE4, inter_node=ETH_100_SHARED_8),
        # The issue names no network for L4 nodes; 100 GbE per node is the common cloud shape (e.g. GCP g2-standard-96).
        ClusterProfile(name="l4-pcie", source="preset:l4-pcie", nodes=1, devices_per_node=8, device=L4,
                       intra_node=PCIE4, inter_node=ETH_100_SHARED_8),
    ]
}


def preset(name: str, *, nodes: int = 1) -> ClusterProfile:
    if name not in PRESETS:
        raise ConfigError(f"unknown cluster preset '{name}'; choose one of {', '.join(PRESETS)} or pass a cluster file")
    if nodes < 1:
        raise ConfigError(f"--nodes must be >= 1, got {nodes}")
    return PRESETS[name].with_nodes(nodes)
