"""The cluster profile: devices, links, probed collective fits, topology, as plain frozen records.

Conventions: bandwidths in bytes per second per device per direction (1 GB/s = 1e9 B/s), latencies in seconds,
FLOP/s dense (no structured sparsity). A link's bandwidth is what one device can push while every device in the
group communicates at once: an inter-node NIC shared by a node's devices is divided among them.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Literal

from cost_models.records.base import Record, record
from cost_models.records.errors import FileFormatError
from cost_models.records.fit import fit_alpha_beta
from cost_models.records.limits import check_nodes

CLUSTER_KIND = "zeropipe.cluster"
CLUSTER_SCHEMA_VERSION = 1

CollectiveOp = Literal["all_gather", "reduce_scatter", "all_reduce", "send_recv", "broadcast", "all_to_all"]


@record
class DeviceSpec(Record):
    name: str
    kind: Literal["gpu", "cpu"]
    memory_bytes: int                  # usable per device (per rank for CPU ranks sharing host memory)
    peak_flops: dict[str, float]       # dtype -> dense FLOP/s (datasheet, or measured for CPU ranks)
    matmul_efficiency: float           # achieved / peak for large matmuls (measured by the compute probe if present)
    source: str
    memory_bandwidth_Bps: float = 0.0  # device memory bandwidth (datasheet, or measured copy rate per rank)
    sm_count: int = 0                  # streaming multiprocessors (GPU datasheet): the waves GEMM tiles run in
                                       # (cost.kernels); 0: unknown, no wave quantization
    attention_efficiency: dict[str, float] = dataclasses.field(default_factory=dict)
                                       # "fwd" / "bwd": fused attention's achieved / peak (cost.kernels);
                                       # empty: the matmul rate


@record
class LinkSpec(Record):
    kind: str                          # nvlink4 | nvlink3 | pcie4 | infiniband | ethernet | gloo-loopback | ...
    bandwidth_Bps: float               # per device, per direction, achievable
    alpha_s: float                     # per-collective-step latency
    source: str


@record
class Sample(Record):
    size_bytes: int                    # the full buffer: all_reduce buffer, all_gather output, reduce_scatter input, p2p message
    seconds: float                     # expected time over repeats of the slowest rank (cluster_probe.expected_seconds:
                                       # their mean less the slowest); the median in files without median_s
    spread_s: float = 0.0              # max - min over repeats
    median_s: float | None = None      # their median (None in older files)


@record
class CollectiveFit(Record):
    """t(S) = alpha_s + beta_s_per_byte * S for one collective over one group, fitted by least squares."""

    op: CollectiveOp
    group_size: int
    scope: Literal["intra", "inter"]
    alpha_s: float
    beta_s_per_byte: float
    r2: float
    samples: tuple[Sample, ...] = ()

    def predict(self, size_bytes: float, *, back_to_back: bool = False) -> float:
        """The expected time of one call (the fit). `back_to_back`: one of a run of calls issued with no compute
        between them (a pipeline rank's per-tensor all-reduces): the fit of
        the repeats' medians, where the samples hold them (cluster_probe's module doc: a small collective's tail
        comes from ranks waiting for a core while others compute, which such a run does not do)."""
        if back_to_back and self._median_line is not None:
            alpha, beta = self._median_line
            return alpha + beta * size_bytes
        return self.alpha_s + self.beta_s_per_byte * size_bytes

    @functools.cached_property
    def _median_line(self) -> tuple[float, float] | None:
        if len(self.samples) < 2 or any(s.median_s is None or s.median_s <= 0 for s in self.samples):
            return None
        # the check above leaves no sample without a median: the filter only narrows the type
        medians = [s.median_s for s in self.samples if s.median_s is not None]
        return fit_alpha_beta([s.size_bytes for s in self.samples], medians)[:2]


@record
class GpuInfo(Record):
    index: int
    name: str
    memory_bytes: int
    pci_bus_id: str
    pcie_gen: int | None = None
    pcie_width: int | None = None
    nvlinks: int = 0                   # active NVLink links
    nvlink_version: int | None = None


@record
class GpuPair(Record):
    a: int
    b: int
    kind: str                          # nvlink | pcie-switch | pcie-hostbridge | numa-node | system
    nvlinks: int = 0                   # direct links between a and b (0 when connected through an NVSwitch)


@record
class Topology(Record):
    gpus: tuple[GpuInfo, ...]
    pairs: tuple[GpuPair, ...]
    nvswitch: bool = False


@record
class ComputeProbe(Record):
    dtype: str
    matmul_n: int                      # n of the n x n x n matmul
    ranks: int                         # ranks running at once
    threads_per_rank: int
    flops_per_rank: float              # median achieved FLOP/s of one rank while all ranks run
    flops_alone: float                 # one rank running alone
    copy_Bps: float = 0.0              # memory bandwidth one rank gets (bytes read + written) while all ranks copy
    copy_alone_Bps: float = 0.0        # the same for one rank copying alone; 0 in presets and older files
    # fixed per-call costs of the runtime (cost_models/profiling/overhead_probe.py); 0 where not probed (presets)
    pipeline_action_s: float = 0.0     # one pipelining schedule action, beyond its compute and p2p (GPipe, 1F1B)
    pipeline_runtime_action_s: float = 0.0   # the same in torch's multi-stage runtime (interleaved 1F1B); 0: as above
    pipeline_split_action_s: float = 0.0     # the same with a split backward (F, I, W: zero-bubble); 0: as above
    # the three above measured with every pair of ranks running a pipeline at once; these with one pipeline over all
    # `ranks` (0: not probed: 2 ranks or fewer, presets and older files)
    pipeline_action_one_s: float = 0.0
    pipeline_runtime_action_one_s: float = 0.0
    pipeline_split_action_one_s: float = 0.0
    fsdp_unit_s: float = 0.0           # one FSDP2 unit per micro-batch, beyond compute and collective latency
    optimizer_tensor_s: float = 0.0    # AdamW step per parameter tensor
    optimizer_dtensor_s: float = 0.0   # the same per DTensor parameter (FSDP2, TP); 0: as optimizer_tensor_s
    rank_rss_bytes: int = 0            # CPU ranks: a probe rank's peak RSS after init_process_group, before any
                                       # tensor (memory.overhead_bytes); 0 on GPUs, in presets and older files
    # CPU ranks: tasks of other programs runnable while the probe ran (host.background_runnable), which share the
    # cores with the ranks (cost.sharing.effective_cores); and the cores the ranks may use. 0: none, not measured
    background_runnable: float = 0.0
    host_cores: int = 0


@record
class CalibrationRun(Record):
    """One run a calibration was fitted on: where it came from and its step time before and after the fit."""

    path: str
    created_at: str                    # the run's (run.json created_at)
    model: str
    strategy: str                      # Strategy.summary
    world_size: int
    measured_step_s: float             # slowest rank's median step
    predicted_before_s: float          # the plan's prediction
    predicted_after_s: float           # with this calibration (planner/calibrate.py's linear model of the estimate)


@record
class Calibration(Record):
    """What real runs showed, fitted by `planner calibrate` (planner/calibrate.py) and applied by the estimate:
    unit forward/backward times, the optimizer step and exposed data-parallel collectives scaled, the per-action
    overhead of the pipeline runtime replaced. A factor the runs could not identify stays at its neutral value and
    is absent from `fitted`."""

    compute_scale: float = 1.0                # x every unit's forward and backward time (not TP collectives)
    optimizer_scale: float = 1.0              # x the optimizer step
    dp_comm_scale: float = 1.0                # x each rank's exposed data-parallel collective time
    pipeline_action_s: float | None = None    # one pipeline action's overhead, instead of the probe's (None: keep it)
    fitted: tuple[str, ...] = ()              # the fields above that the runs identified
    runs: tuple[CalibrationRun, ...] = ()
    mape_before: float = 0.0                  # step-time MAPE over the runs, the plans' predictions
    mape_after: float = 0.0                   # the same with this calibration
    created_at: str = ""

    def describe(self) -> str:
        """One line: which runs, when (shown wherever a calibrated estimate is)."""
        if not self.runs:
            return "calibrated by hand (no runs recorded)"
        shown = ", ".join(f"{r.path} ({r.created_at})" for r in self.runs[:3])
        more = f" and {len(self.runs) - 3} more" if len(self.runs) > 3 else ""
        return f"calibrated by {len(self.runs)} run(s): {shown}{more}"


def check_calibration(c: "ClusterProfile", where: str) -> None:
    """Scales must be positive (validate_cluster has checked every number is finite and non-negative)."""
    cal = c.calibration
    if cal is None:
        return
    for name in ("compute_scale", "optimizer_scale", "dp_comm_scale"):
        if getattr(cal, name) <= 0:
            raise FileFormatError(f"{where}: cluster.calibration.{name} is {getattr(cal, name)!r}; need > 0; "
                                  f"re-run planner calibrate")


@record
class ClusterProfile(Record):
    name: str
    source: str                        # "probe", "preset:dgx-h100", "file:path"
    nodes: int
    devices_per_node: int
    device: DeviceSpec
    intra_node: LinkSpec
    inter_node: LinkSpec | None = None
    fits: tuple[CollectiveFit, ...] = ()
    topology: Topology | None = None
    compute: ComputeProbe | None = None
    backend: str | None = None
    notes: tuple[str, ...] = ()
    calibration: Calibration | None = None   # fitted from runs (planner calibrate); None: predictions as probed

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    def with_nodes(self, nodes: int) -> "ClusterProfile":
        check_nodes(nodes, self.devices_per_node)   # every --nodes scaling comes through here
        return dataclasses.replace(self, nodes=nodes, name=f"{self.name.split(' x ')[0]} x {nodes}" if nodes > 1 else self.name)

    def fit(self, op: str, group_size: int, scope: str = "intra") -> CollectiveFit | None:
        for f in self.fits:
            if f.op == op and f.group_size == group_size and f.scope == scope:
                return f
        return None


