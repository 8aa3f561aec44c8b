"""estimate(strategy, model profile, cluster) -> Estimate: step time with its breakdown and per-rank memory.

Step time = the pipeline's makespan, simulated with each stage's per-micro-batch times and p2p transfers
(cost_models.records.schedule), split into compute, bubble and exposed p2p; plus each rank's exposed data-parallel
collectives after its last backward; plus the optimizer step. Data-parallel traffic per step follows what the
executor runs (ZeRO paper, section 7: 2Ψ for stages 0-2, 3Ψ for stage 3, per gathered micro-batch):
    ZeRO-0  all-reduce of gradients (DDP, no_sync until the last micro-batch)
    ZeRO-1  all-reduce of gradients + broadcasts of updated parameters (ZeroRedundancyOptimizer's, per tensor)
    ZeRO-2  without a pipeline, FSDP2 gathers and reduce-scatters every micro-batch; in a pipeline torch's stage
            gathers once per step and reduce-scatters once
    ZeRO-3  without a pipeline, FSDP2 gathers parameters for every micro-batch's forward and again for its backward
            and reduce-scatters every micro-batch; in a pipeline it gathers for every forward and once for the
            backward (m + 1, counted) and reduce-scatters once
Overlap: without a pipeline on GPUs, FSDP2's one-unit-ahead prefetch and DDP's bucketed all-reduce hide
communication behind compute unit by unit (see _overlapped_dp_time); what does not fit is exposed, and what fits
still slows the compute beside it (comm.overlapped_exposure: Lee et al. 2025, 18.9% on average). With a
pipeline, each stage is one FSDP unit: its gathers run inside the forwards (and ZeRO-3's first backward) that wait
for them, so they are simulated on the pipeline's critical path (_stage_gather); the final reduce-scatter and
the gradient syncs come after the stage's work and are exposed, then tied gradients are all-reduced across the
pipeline ranks sharing them (_tied_sync). CPU ranks share their cores with gloo's threads: nothing is assumed
hidden there.

A calibrated cluster (cluster.calibration, fitted from runs by planner/calibrate.py) scales the unit times, the
optimizer step and the exposed data-parallel time by its factors and replaces the per-action overhead; nothing else.

Tensor parallelism (tp > 1; mesh (pp, dp, tp), tp innermost as torchtitan orders it, so a TP group is tp adjacent
ranks inside a node and a dp group's ranks are tp apart): each unit's compute is its TP rank's share
(compute.tp_unit_times), plus its TP collectives (comm.tp_unit_traffic: Megatron's two all-reduces per layer in
forward and two in backward, Shoeybi et al. 2019 section 3; all-gather + reduce-scatter under SP, Korthikanti et al.
2022 section 4.2.2) on the TP group's link, exposed: they sit between dependent GEMMs (Megatron-LM runs them
synchronously), unless async TP overlaps them (Strategy.async_tp: max(t / tp, t - compute) per unit and pass,
Wang et al. 2023). Parameters, gradients and
optimizer states of the split modules are divided by tp before ZeRO divides the rank's share by dp; activations
are split by role (memory.tp_saved_bytes, Korthikanti et al. 2022 Table 2). Selective recompute drops the attention
core's saved tensors and adds its forward to the backward (Korthikanti et al. 2022, section 5).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Protocol, Sequence

from cost_models.cost.comm import (TP_OPS, Traffic, collective_time, group_link, group_ranks_per_node, linearized,
                                   overlapped_exposure, p2p_time, norm_grad_traffic, tp_unit_traffic)
from cost_models.cost.compute import (compute_dtype, compute_source, executed_dtype, executed_precision,
                                      optimizer_step_time, priced_by_kind, tp_unit_times, unit_times)
from cost_models.cost.context_parallel import CPUnitCost, cp_origin, cp_refusal, cp_unit, cp_view
from cost_models.cost.kernels import work_seconds
from cost_models.cost.moe import (all_to_all_time, busiest_load, busiest_peak_load, check_ep, dispatch_bytes,
                                  ep_saved_bytes, ep_work, imbalance, peak_imbalance)
from cost_models.cost.memory import (MemoryBreakdown, autocast_copy_bytes, comm_buffer_bytes, executor_state_bytes,
                                     held_bytes_per_param, overhead_bytes, saved_at, torch_mixed, tp_param_share,
                                     tp_saved_bytes, zero1_partition)
from cost_models.cost.sharing import CoreSharing, action_seconds, core_sharing, stretched_backward, stretches
from cost_models.cost.simulator import Simulation, StageCost, simulate_schedule
from cost_models.records.base import Record, record
from cost_models.records.cluster import Calibration, ClusterProfile, ComputeProbe
from cost_models.records.errors import ConfigError
from cost_models.records.precision import BYTES_PER_PARAM, DTYPE_BYTES
from cost_models.records.profile import ModelProfile, UnitProfile, counts_positions, items_per_sequence
from cost_models.records.schedule import format_order, get_spec
from cost_models.records.strategy import Strategy, priced_digest
from cost_models.records.tensor_parallel import vocab_divides

# presets carry no probe: no per-call overheads are assumed there (GPU launches mostly hide behind kernels)
_NO_OVERHEADS = ComputeProbe(dtype="", matmul_n=0, ranks=1, threads_per_rank=1, flops_per_rank=0.0, flops_alone=0.0)


class CollFn(Protocol):
    def __call__(self, op: str, size: float, back_to_back: bool = False) -> float:
        """(op, full buffer bytes, one of a run of calls with no compute between them) -> seconds over the
        strategy's dp group."""


@record
class StepBreakdown(Record):
    compute_s: float        # the critical rank's forward + backward (+ recompute) over all micro-batches, with
                            # the FSDP gathers they wait for in a pipeline (_stage_gather)
    bubble_s: float         # pipeline idle time on that rank with free p2p
    p2p_s: float            # makespan added by p2p transfers
    dp_comm_s: float        # exposed collectives after that rank's pipeline work: data-parallel ones, and the
                            # all-reduce of tied gradients across pipeline ranks with its wait for the peer (_tied_sync)
    optimizer_s: float
    total_s: float
    tp_comm_s: float = 0.0  # tensor-parallel collectives on that rank (exposed; inside compute_s)
    ep_comm_s: float = 0.0  # expert-parallel all-to-alls on that rank (exposed; inside compute_s)
    cp_comm_s: float = 0.0  # context-parallel gathers of keys and values on that rank (exposed; inside compute_s)


@record
class StageEstimate(Record):
    stage: int
    units: tuple[str, ...]
    params: int             # parameters the stage holds (a tied parameter counts in every stage that uses it);
                            # with tp > 1 one TP rank's share
    fwd_s: float            # per micro-batch
    bwd_s: float            # per micro-batch, incl. recompute
    activation_bytes: float # kept per micro-batch in flight
    boundary_bytes: float   # what it sends to the next stage per micro-batch
    peak_in_flight: int
    send_fwd_s: float = 0.0 # p2p time of its output to the next stage (per micro-batch)
    send_bwd_s: float = 0.0 # p2p time of its input gradient to the previous stage
    pp_rank: int = 0               # the pipeline rank that runs it (the schedule's placement)
    largest_unit_params: int = 0   # its largest unit's parameters (FSDP2 gathers one unit at a time)
    working_set_bytes: float = 0.0 # with recompute: one unit's saved activations, live while it is recomputed
    tp_comm_s: float = 0.0         # per micro-batch: its TP collectives (forward + backward, in fwd_s / bwd_s)
    tp_bytes: dict[str, float] = dataclasses.field(default_factory=dict)  # per micro-batch: op -> full-buffer
                                   # bytes of its TP collectives (forward, recomputed forward, backward)
    kept_bytes: float = 0.0        # of activation_bytes, what each micro-batch keeps until the step ends (_kept)
    gather_s: float = 0.0          # one FSDP all-gather of its parameters over dp (ZeRO-2/3 in a pipeline)
    gather_every_forward: bool = False   # ZeRO-3: before every forward and micro-batch 0's backward; ZeRO-2: once,
                                         # before micro-batch 0's forward (_stage_gather)
    bwd_input_fraction: float = 0.5      # of bwd_s, the input-gradient part (I) under a split backward; W the rest
                                         # (StageCost's; _shared moves it where I and W share cores differently)
    expert_params: int = 0         # of params, the routed experts' on this rank under expert parallelism (ep > 1;
                                   # their ZeRO group is dp / ep: cost.moe); 0 without
    ep_comm_s: float = 0.0         # per micro-batch: its expert-parallel all-to-alls (in fwd_s / bwd_s)
    ep_fwd_s: float = 0.0          # of ep_comm_s, the forward's (in fwd_s); the rest in bwd_s (a recomputed
                                   # forward's among them); 0 in plans written before it was recorded
    ep_bytes: float = 0.0          # per micro-batch: their full-buffer bytes (forward, recomputed forward, backward)
    cp_comm_s: float = 0.0         # per micro-batch: its context-parallel collectives (in fwd_s / bwd_s)
    cp_bytes: float = 0.0          # per micro-batch: their full-buffer bytes (cost.context_parallel.cp_unit)

    def cost(self) -> StageCost:
        """The simulator's view of this stage (reports re-simulate the plan's timeline from it): its gathers delay
        the forwards and backward that wait for them."""
        every = self.gather_every_forward
        return StageCost(fwd_s=self.fwd_s + (self.gather_s if every else 0.0), bwd_s=self.bwd_s,
                         bwd_input_fraction=self.bwd_input_fraction, send_fwd_s=self.send_fwd_s,
                         send_bwd_s=self.send_bwd_s,
                         activation_bytes=self.activation_bytes, kept_bytes=self.kept_bytes,
                         first_fwd_extra_s=0.0 if every else self.gather_s,
                         first_bwd_extra_s=self.gather_s if every else 0.0)


@record
class CommVolume(Record):
    p2p_bytes_per_step: float        # activations + gradients crossing stage boundaries, one pipeline
    dp_bytes_per_rank: float         # data-parallel collectives per rank per step in full-buffer bytes (as
                                     # CommCounter counts them), not wire bytes: comm.dp_wire_bytes
    dp_collectives: dict[str, float] # op -> bytes per rank per step
    p2p_link: str
    dp_link: str
    tp_bytes_per_rank: float = 0.0   # bytes each rank moves in tensor-parallel collectives per step (full buffers)
    tp_collectives: dict[str, float] = dataclasses.field(default_factory=dict)  # op -> bytes per rank per step
    tp_link: str = "none"            # the TP group's link: "intra-node" (or "inter-node" where tp > a node)
    tied_bytes_per_rank: float = 0.0 # pipeline rank 0's all-reduce of tied gradients across pipeline ranks per step
                                     # (_tied_sync; its local gradient: a ZeRO-2/3 shard), counted as CommCounter does
    ep_bytes_per_rank: float = 0.0   # expert-parallel all-to-alls per rank per step, the mean over pipeline ranks
                                     # (full buffers: what a rank hands all_to_all_single; cost.moe)
    ep_link: str = "none"            # the EP group's link: "intra-node" | "inter-node"
    cp_bytes_per_rank: float = 0.0   # context-parallel gathers and reduce-scatters per rank per step, the mean over
                                     # pipeline ranks (full buffers)
    cp_link: str = "none"            # the CP group's link: "intra-node" | "inter-node"


@record
class Estimate(Record):
    step_time_s: float
    breakdown: StepBreakdown
    bubble_ratio: float      # (makespan - ideal) / ideal, Narayanan et al.'s (p-1)/m convention
    bubble_share: float      # idle share of all rank-time in the pipeline
    tokens_per_step: int     # tokens (sequences x seq_len) for token and feature-sequence inputs; samples for others
    tokens_per_s: float
    throughput_unit: str = "tokens"   # what tokens_* count: "tokens" | "samples" (an input with no sequence axis)
    mfu: float | None        # model FLOPs (PaLM: 3 x forward, no recompute) / (step time x world x peak); None
                             # where the peak is unknown
    stages: tuple[StageEstimate, ...]
    memory_per_rank: tuple[MemoryBreakdown, ...]
    capacity_bytes: int
    fits: bool
    comm: CommVolume
    compute_source: str      # "measured" (profile times on this device kind) | "kernels" (work by kind on a GPU:
                             # cost.kernels) | "flops" (FLOPs / peak x efficiency)
    pipeline_order: dict[str, list[str]]
    hfu: float | None = None # hardware FLOPs (with recompute, torch's attention backward) / the same; see _throughput
    calibrated_by: str = ""  # "" as probed; else Calibration.describe() of the cluster's calibration (which runs)
    priced: str = ""         # records.strategy.priced_digest of the strategy and model priced; "" in older files
    ep_load: float = 1.0     # under EP: the busiest EP rank's routed tokens over the mean, as priced (cost.moe.
                             # imbalance, the largest over MoE units); 1 without EP and in older files
    ep_peak_load: float = 1.0   # and in its worst micro-batch, which its activations are priced at (cost.moe.
                                # peak_imbalance, the largest over MoE units); 1 without EP and in older files

    @property
    def peak_memory_bytes(self) -> int:
        return max(m.total_bytes for m in self.memory_per_rank)


# --- the tied-parameter rule --------------------------------------------------------------------------------------

def tied_copies(profile: ModelProfile, unit: str, stage_units: Sequence[str]) -> list[int]:
    """Sizes of the tied parameters `unit` uses whose owning unit is in another stage: its stage holds a copy (each
    pipeline stage owns the modules it runs; the executor all-reduces tied gradients across the copies). Pass no
    stage units for every tied parameter the unit uses (the memory-aware partitioner's bound, before stages exist).
    Each tied tensor counts once however many of its aliases the unit uses."""
    uses = set(profile.unit(unit).shared_params)
    return [sp.numel for sp in profile.shared if uses & set(sp.aliases) and sp.units[0] not in stage_units]


def held_params(profile: ModelProfile, unit: str, stage_units: Sequence[str]) -> int:
    """Parameters `unit` holds in a stage of `stage_units` without tensor parallelism: its own and a copy of each
    tied parameter whose owner is elsewhere (tied_copies; no stage units: every tied parameter it uses). The
    stages' model states count these (_rank_params), and so does the memory-aware partitioner (planner.search)."""
    return profile.unit(unit).params + sum(tied_copies(profile, unit, stage_units))


def _rank_params(c: "_Context", unit: str, stage_units: Sequence[str]) -> int:
    """Parameters one rank holds of `unit` in its stage: with tp > 1 the split modules' share, and of a tied copy
    a tp-th where the vocabulary splits (the tied weights plans split are the vocabulary's: the zoo GPT's embedding
    and head, records.tensor_parallel), else the whole copy."""
    moe, share = c.profile.unit(unit).moe, _expert_share(c, unit)
    away = moe.expert_params - share if moe is not None and share else 0
    if c.s.tp == 1:
        return held_params(c.profile, unit, stage_units) - away
    copies = sum(tied_copies(c.profile, unit, stage_units))
    own = tp_param_share(c.profile.unit(unit).params, c.profile.unit(unit).tp, c.s.tp, c.tp_vocab)
    return round(own + (copies / c.s.tp if c.tp_vocab else copies)) - away


def _expert_share(c: "_Context", unit: str) -> int:
    """The routed experts' parameters of `unit` one rank holds under expert parallelism (E / ep of each block's
    experts, whole over tp: cost.moe), 0 without it or in a dense unit."""
    moe = c.profile.unit(unit).moe
    return moe.expert_params // c.s.ep if moe is not None and c.s.ep > 1 else 0


def _unit_numels(profile: ModelProfile, unit: str, stage_units: Sequence[str], *, tp: int = 1,
                 vocab: bool = False) -> list[int]:
    """Sizes of the parameter tensors a unit holds in its stage (tied copies included; a TP rank's shares of the
    split ones); [] for old profiles."""
    u = profile.unit(unit)
    if not u.param_numels:
        return []
    numels = list(u.param_numels)
    if tp > 1 and u.tp is not None and u.tp.param_split:
        numels = [n // tp if f == 1 or (f == 2 and vocab) else n for n, f in zip(numels, u.tp.param_split)]
    copies = tied_copies(profile, unit, stage_units)
    return numels + ([n // tp for n in copies] if tp > 1 and vocab else copies)   # split as _rank_params says


# --- pass 1: stage costs ------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Context:
    """What every pass reads: the strategy, the model, the cluster and the derived byte sizes."""
    s: Strategy
    profile: ModelProfile
    cluster: ClusterProfile
    param_bytes: int
    grad_bytes: int
    act_scale: float          # profile's saved bytes -> this micro-batch size and compute dtype
    overheads: ComputeProbe
    unit_index: dict[str, int]  # unit name -> position in the model's chain
    sharing: CoreSharing        # how CPU ranks sharing cores slow this strategy (sharing.core_sharing)
    tp_on: bool = False         # tensor parallelism or selective recompute: units are costed by TP role
    tp_vocab: bool = False      # the embedding and head split on the vocabulary at this tp
    tp_cost: tuple[tuple[float, float], ...] = ()  # per op in TP_OPS: (s per call, s per profile byte) over tp
    calibration: Calibration = Calibration()       # the cluster's, or the neutral one
    mixed: bool = False         # torch's mixed precision (memory.torch_mixed): fp32 masters, bf16 compute
    autocast: bool = False      # ... through torch.autocast (no FSDP2 casting for it): unit times pay mixed_factor
    cp: int = 1                 # context parallelism: `s` and `profile` are its data view (cost.context_parallel)

    @staticmethod
    def of(s: Strategy, profile: ModelProfile, cluster: ClusterProfile, cp: int = 1) -> "_Context":
        p_b, g_b, _ = BYTES_PER_PARAM[(s.precision, s.optimizer)]
        mixed = torch_mixed(s.precision, cluster.device.kind, s.pp)
        scale = activation_scale(profile, micro_batch_size=s.micro_batch_size, precision=s.precision)
        shape = profile.tensor_parallel
        tp_cost: tuple[tuple[float, float], ...] = ()
        if s.tp > 1:
            # one TP buffer (b x s x h in the compute dtype) as the secant's reference size
            ref = max(1.0, profile.micro_batch_size * profile.seq_len * (shape.hidden if shape else 1) * scale
                      * DTYPE_BYTES[profile.dtype])
            tp_cost = tuple((a, b * scale) for a, b in (linearized(cluster, op, s.tp, ref) for op in TP_OPS))
        cal = cluster.calibration or Calibration()
        overheads = cluster.compute or _NO_OVERHEADS
        return _Context(s=s, profile=profile, cluster=cluster, param_bytes=p_b, grad_bytes=g_b, act_scale=scale,
                        overheads=overheads, calibration=cal,
                        unit_index={u.name: i for i, u in enumerate(profile.units)},
                        tp_on=s.tp > 1 or s.selective, tp_vocab=shape is not None and vocab_divides(shape, s.tp),
                        tp_cost=tp_cost, mixed=mixed,
                        autocast=mixed and not s.gathers_per_unit, sharing=core_sharing(s, cluster), cp=cp)


def dtype_ratio(profile: ModelProfile, precision: str) -> float:
    """The compute dtype's element size over the profile's."""
    return DTYPE_BYTES[compute_dtype(precision)] / DTYPE_BYTES[profile.dtype]


def activation_scale(profile: ModelProfile, *, micro_batch_size: int, precision: str) -> float:
    """Factor from the profile's activation bytes to a micro-batch of `micro_batch_size` in the compute dtype
    (activations scale linearly with the batch and with the element size; memory.saved_at corrects saved bytes
    for the parts that do neither)."""
    return (micro_batch_size / profile.micro_batch_size) * dtype_ratio(profile, precision)


def _crosses_nodes(rank_a: int, rank_b: int, cluster: ClusterProfile) -> bool:
    return rank_a // cluster.devices_per_node != rank_b // cluster.devices_per_node


def _boundary_bytes(profile: ModelProfile, last: int) -> float:
    """Bytes a stage ending at unit `last` sends on per micro-batch: that unit's output in a chain; in a DAG, every
    edge from a unit at or before it to a unit after it (skip connections ride along through later stages)."""
    if not profile.edges:
        return float(profile.units[last].output_bytes)
    return float(sum(e.bytes for e in profile.edges if e.src <= last < e.dst))


def _stage_input_bytes(c: _Context, first: int) -> float:
    profile = c.profile
    if first == 0:
        tokens = profile.input.kind == "tokens"
        input_bytes = math.prod(profile.input.shape) * (8 if tokens else DTYPE_BYTES[profile.dtype])
        return input_bytes * c.s.micro_batch_size / profile.micro_batch_size
    return profile.units[first - 1].output_bytes * c.act_scale


def _tp_seconds(c: _Context, traffic: Traffic) -> float:
    """Seconds of one unit's TP collectives in one pass: calls x alpha + bytes x beta per op (comm.linearized)."""
    return sum(traffic[2 * i] * a + traffic[2 * i + 1] * b for i, (a, b) in enumerate(c.tp_cost))


def _tp_unit(c: _Context, u: UnitProfile, recompute: bool, acc: list[float]) -> tuple[float, float, float]:
    """(forward, backward, saved bytes at the profile's scale) of one micro-batch through `u` on one TP rank: its
    compute share, its TP collectives (exposed), selective recompute's core forward in the backward (module doc).
    Adds the unit's TP bytes (per op in TP_OPS, forward again when recomputed) and collective seconds to acc."""
    s = c.s
    selective = s.selective and not recompute
    f, b, core = (t * c.calibration.compute_scale for t in tp_unit_times(
        u, c.profile, c.cluster, micro_batch_size=s.micro_batch_size, precision=s.precision,
        ranks_running=c.sharing.busy, tp=s.tp, vocab=c.tp_vocab, mixed=c.autocast, sp=s.sp))
    # saving SP's shards works outside full recompute only (a checkpointed unit keeps its input alone)
    shard = s.sp_save_shard and not recompute
    saved = tp_saved_bytes(_saved(c, u), u.tp, tp=s.tp, sp=s.sp, selective=selective, vocab=c.tp_vocab,
                           save_shard=shard)
    if selective:
        b += core
    if s.tp > 1 and u.tp is not None:
        shape = c.profile.tensor_parallel   # never None where tp_vocab is set (_Context.of)
        vocab = shape.vocab if c.tp_vocab and shape else 0
        fwd_t, bwd_t = tp_unit_traffic(u.tp, sp=s.sp, vocab=vocab, save_shard=shard)
        norms = norm_grad_traffic(u.tp, c.grad_bytes, sp=s.sp)
        tf, tb = _tp_seconds(c, fwd_t), _tp_seconds(c, bwd_t)
        if s.async_tp:   # each collective cut into tp steps behind partial matmuls: the first step's transfer
            # shows, and what the pass's compute cannot cover (Strategy.tp_label); a saved shard's gather runs
            # when backward unpacks it, before any matmul: exposed
            again = tb - _tp_seconds(c, tp_unit_traffic(u.tp, sp=s.sp, vocab=vocab)[1]) if shard else 0.0
            tf, tb = max(tf / s.tp, tf - f), max((tb - again) / s.tp, tb - again - b) + again
        tb += _tp_seconds(c, norms)   # the norms' gradient all-reduce stays whole
        f, b = f + tf, b + tb
        passes = 2 if recompute else 1
        for i in range(len(TP_OPS)):
            acc[i] += (passes * fwd_t[2 * i + 1] + bwd_t[2 * i + 1]) * c.act_scale + norms[2 * i + 1]
        acc[-1] += passes * tf + tb
    return f, b, saved


# Per-unit costs depend on the unit and a few of the strategy's fields only, and the planner costs thousands of
# strategies over the same profile and cluster: they are kept per (profile, cluster) object pair. The pair is held
# by the cache, so its ids cannot be reused by other objects while the entry lives; a few pairs are kept.
# per pair: (profile, cluster, unit costs by key, unit name -> its identical twin's name: _twins)
_UNIT_COSTS: dict[tuple[int, int], tuple[ModelProfile, ClusterProfile, dict, dict[str, str]]] = {}
# A search costs one profile per context-parallel degree (cost.context_parallel.cp_view, up to 15 for powers of
# two to 16,384 GPUs) in one branch-and-bound, interleaved: each must stay.
_UNIT_COST_PAIRS = 16
_NO_CP = CPUnitCost()


def action_cost(s: Strategy, cluster: ClusterProfile) -> float:
    """One pipeline schedule action's overhead for `s` on `cluster`, beyond its compute and p2p: a calibration's
    fitted value as it is (fitted from runs, whatever the schedule's kind); else the probe's for the schedule's kind
    with the plan's dp x tp pipelines running at once (sharing.action_seconds): on CPU ranks that share cores, the
    pairs' cost priced one pipeline over all ranks at twice its measured step, and plans that run as pairs close
    to theirs (measured: benchmarks/results/measurements.md, "Pipeline action overhead")."""
    cal = cluster.calibration
    if cal is not None and cal.pipeline_action_s is not None:
        return cal.pipeline_action_s
    if cluster.compute is None:
        return 0.0
    return action_seconds(cluster.compute, multi_stage=s.spec.multi_stage, split_backward=s.spec.split_backward,
                          pipelines_at_once=s.ranks_per_stage)


def _unit_cost(c: _Context, name: str,
               recompute: bool) -> tuple[float, float, float, float, float, float, tuple[float, ...]]:
    """(forward, backward, saved bytes at the profile's scale, EP all-to-all seconds and bytes and the forward's
    seconds of them, TP bytes per op + TP seconds or ()) of one micro-batch through unit `name` (_tp_unit with
    tensor parallelism or selective
    recompute, else unit_times; _ep_unit under expert parallelism)."""
    s = c.s
    entry = _unit_entry(c)
    name = entry[3].get(name, name)
    key = (name, s.micro_batch_size, s.precision, c.sharing.busy, s.tp, s.sp, s.selective, recompute, c.tp_on,
           c.tp_vocab, s.optimizer, c.autocast, s.async_tp, s.sp_save_shard, s.ep,
           _dealt(c, name))
    hit = entry[2].get(key)
    if hit is None:
        u = c.profile.unit(name)
        if c.tp_on:
            acc = [0.0] * (len(TP_OPS) + 1)
            f, b, kept = _tp_unit(c, u, recompute, acc)
            tp_acc: tuple[float, ...] = tuple(acc)
        else:
            f, b = unit_seconds(u, c.profile, c.cluster, micro_batch_size=s.micro_batch_size, precision=s.precision,
                                ranks_running=c.sharing.busy, mixed=c.autocast)
            kept, tp_acc = _saved(c, u), ()
        hit = (*_ep_unit(c, u, f, b, kept, recompute), tp_acc)
        entry[2][key] = hit
    return hit


def _dealt(c: _Context, name: str) -> tuple[int, ...]:
    """What else the unit's costs depend on where its routing was measured per window (cost.moe.peak_imbalance
    deals the windows over the replicas and micro-batches): part of the unit-cost cache's key."""
    moe = c.profile.unit(name).moe
    return (c.s.dp, c.s.microbatches) if c.s.ep > 1 and moe is not None and moe.window_load else ()


def _unit_entry(c: _Context) -> tuple[ModelProfile, ClusterProfile, dict, dict[str, str]]:
    """The unit-cost cache of the context's (profile, cluster) pair (_UNIT_COSTS), made on first use."""
    pair = (id(c.profile), id(c.cluster))
    entry = _UNIT_COSTS.get(pair)
    if entry is None:
        if len(_UNIT_COSTS) >= _UNIT_COST_PAIRS:
            _UNIT_COSTS.pop(next(iter(_UNIT_COSTS)))
        entry = _UNIT_COSTS[pair] = (c.profile, c.cluster, {}, _twins(c.profile))
    return entry


def _cp_cost(c: _Context, name: str, recompute: bool) -> CPUnitCost:
    """cost.context_parallel.cp_unit of unit `name` in this context, kept with its unit costs (_unit_entry)."""
    if c.cp == 1:
        return _NO_CP
    cache = _unit_entry(c)[2]
    key = ("cp", name, c.cp, c.s.tp, c.act_scale, recompute)
    hit = cache.get(key)
    if hit is None:
        hit = cache[key] = cp_unit(c.profile.unit(name), c.cluster, cp=c.cp, tp=c.s.tp, act_scale=c.act_scale,
                                   recompute=recompute)
    return hit


def _ep_unit(c: _Context, u: UnitProfile, f: float, b: float, kept: float,
             recompute: bool) -> tuple[float, float, float, float, float, float]:
    """(forward, backward, saved bytes at the profile's scale, all-to-all seconds, all-to-all bytes, the forward's
    all-to-all seconds) of one micro-batch through `u` under expert parallelism (cost.moe's module doc): its routed
    experts' share of the compute at the busiest EP rank's load, and what they and the dispatch keep
    (cost.moe.ep_saved_bytes) at its load in the worst micro-batch (cost.moe.peak_imbalance: every micro-batch in
    flight priced at it, an upper bound); dispatch and combine all-to-alls in forward and again in backward,
    exposed (each sits between the router and the experts, or the experts and what follows: nothing computes beside
    it in one micro-batch's stream). The all-to-all seconds and bytes count the forward's twice under full
    recompute (the stage adds the forward's seconds to the backward). As given without EP or MoE blocks."""
    m, s = u.moe, c.s
    if m is None or s.ep == 1:
        return f, b, kept, 0.0, 0.0, 0.0
    load = imbalance(c.profile, m, s.ep)
    extra = load - 1.0
    shaped = [ep_work(w, m, ep=s.ep, load=load) for w in (u.fwd_work, u.bwd_work) if w is not None]
    if priced_by_kind(u, c.profile, c.cluster, s.precision) and all(w is not None for w in shaped):
        # the busiest rank's products at their EP shapes (a profile whose routed products were found: ep_work)
        dtype = executed_dtype(s.precision, c.cluster.device.kind)
        for work, new, backward in ((u.fwd_work, shaped[0], False), (u.bwd_work, shaped[1], True)):
            assert work is not None and new is not None   # priced_by_kind
            now = work_seconds(work, c.cluster.device, dtype, backward=backward)
            ratio = work_seconds(new, c.cluster.device, dtype, backward=backward) / now if now > 0 else 1.0
            f, b = (f, b * ratio) if backward else (f * ratio, b)
    else:   # measured times, or products not found: the routed experts' share of the FLOPs at the busiest load
        f += f * extra * (m.routed_fwd_flops / u.fwd_flops if u.fwd_flops else 0.0)
        b += b * extra * (m.routed_bwd_flops / u.bwd_flops if u.bwd_flops else 0.0)
    size = dispatch_bytes(m, scale=s.micro_batch_size / c.profile.micro_batch_size,
                          elem_bytes=DTYPE_BYTES[compute_dtype(s.precision)])
    rpn = group_ranks_per_node(c.cluster, n=s.ep, stride=s.tp)
    # each forward first exchanges the token counts per expert (an int64 each), then dispatches and combines
    counts = m.blocks * m.experts * 8
    fwd = all_to_all_time(c.cluster, counts, s.ep, ranks_per_node=rpn) + 2 * all_to_all_time(
        c.cluster, size, s.ep, ranks_per_node=rpn)
    bwd = 2 * all_to_all_time(c.cluster, size, s.ep, ranks_per_node=rpn)
    passes = 2 if recompute else 1
    peak = peak_imbalance(c.profile, m, ep=s.ep, dp=s.dp, micro_batch_size=s.micro_batch_size,
                          microbatches=s.microbatches)
    kept += ep_saved_bytes(m, load=peak, elem_bytes=DTYPE_BYTES[c.profile.dtype],
                           dtype_ratio=dtype_ratio(c.profile, s.precision)) - m.routed_saved_bytes
    return (f + fwd, b + bwd, kept, passes * fwd + bwd,
            passes * (counts + 2 * size) + 2 * size, fwd)


def _twins(profile: ModelProfile) -> dict[str, str]:
    """Unit name -> the first unit equal to it but for its name, modules and what a split backward keeps by
    position (split_*: _kept reads them by name, not _unit_cost), whose costs it shares (a meta profile's identical
    blocks: a 70B model's 80 are priced once per strategy shape, not 80 times)."""
    first: dict[tuple, list[UnitProfile]] = {}
    out: dict[str, str] = {}
    for u in profile.units:
        group = first.setdefault((u.params, u.fwd_flops, u.bwd_flops, u.saved_bytes, u.output_bytes), [])
        twin = next((t for t in group if dataclasses.replace(
            u, name=t.name, modules=t.modules, split_after_bytes=t.split_after_bytes,
            split_suffix_bytes=t.split_suffix_bytes) == t), None)
        if twin is None:
            group.append(u)
        else:
            out[u.name] = twin.name
    return out


def unit_seconds(u: UnitProfile, profile: ModelProfile, cluster: ClusterProfile, *, micro_batch_size: int,
                 precision: str, ranks_running: float, mixed: bool) -> tuple[float, float]:
    """(forward, backward) seconds of one micro-batch through `u` without tensor parallelism or selective
    recompute, as a stage's units are priced (_unit_cost): compute.unit_times scaled by the cluster's calibration.
    `mixed`: under torch's autocast (_Context.autocast). The planner's bounds price units with it too."""
    scale = (cluster.calibration or Calibration()).compute_scale
    f, b = unit_times(u, profile, cluster, micro_batch_size=micro_batch_size, precision=precision,
                      ranks_running=ranks_running, mixed=mixed)
    return f * scale, b * scale


def unit_costs(strategy: Strategy, profile: ModelProfile, cluster: ClusterProfile, *,
               cp: int = 1) -> list[tuple[float, float]]:
    """Each unit's (forward, backward) seconds of one micro-batch on one TP rank as `estimate` prices it in a stage
    of `strategy` without recompute (_unit_cost: its compute share, TP collectives, selective recompute's core in
    the backward; `cp` > 1, where `profile` is its cp_view: the key/value gathers and their gradients'
    reduce-scatters _stage adds), before what the stage adds (per-action and FSDP-hook overheads, the sharing of
    CPU cores). The strategy's stages are not read. The planner's time bounds read them (planner.search._UnitTimes)."""
    c = _Context.of(executed(strategy, cluster), profile, cluster, cp)
    out = []
    for u in profile.units:
        f, b = _unit_cost(c, u.name, False)[:2]
        ctx = _cp_cost(c, u.name, False)
        out.append((f + ctx.fwd_s, b + ctx.bwd_s))
    return out


def saved_bytes(profile: ModelProfile, u: UnitProfile, *, micro_batch_size: int, precision: str) -> float:
    """What one micro-batch through `u` saves for backward without tensor parallelism or recompute, at the
    profile's scale (times activation_scale: bytes): memory.saved_at at this micro-batch in the compute dtype, as a
    stage's activations count it (_saved) and the memory-aware partitioner too (planner.search)."""
    return saved_at(u, micro_batch_size=micro_batch_size, profile_batch=profile.micro_batch_size,
                    dtype_ratio=dtype_ratio(profile, precision))


def _saved(c: _Context, u: UnitProfile) -> float:
    return saved_bytes(c.profile, u, micro_batch_size=c.s.micro_batch_size, precision=c.s.precision)


def _working_set(c: _Context, units: tuple[str, ...], saved: list[float], stage_input: float) -> float:
    """With full recompute, the most one unit keeps while it is recomputed in backward: its saved bytes less its
    input, which the in-flight term already holds (the checkpoint keeps it; a norm or linear saves that same
    storage again, measured by executor.activations as one storage)."""
    inputs = [stage_input] + [c.profile.units[c.unit_index[n] - 1].output_bytes * c.act_scale for n in units[1:]]
    return max(max(0.0, kept * c.act_scale - held) for kept, held in zip(saved, inputs))


def _kept(c: _Context, sid: int, units: tuple[str, ...], recompute: bool) -> float:
    """What each micro-batch keeps on a stage until the step ends under torch's split backward (I, then W): the saved
    tensors of its nodes on no weight's path, measured in context by profiling.split_backward.split_kept_in_stages (a
    last stage from its first unit to the loss; a middle stage as its first unit alone plus each later one after the
    unit before it). I runs with retain_graph and W starts from the
    intermediates I kept, so those are freed only with the graph, which a stage holds to the end of the step (the
    last stage's outputs and losses; measured by executor.activations, torch 2.13: every stage but the first, which
    runs one full backward at W, keeps them; accuracy in benchmarks/results/measurements.md, "Activation accuracy").
    Not modelled (0) for a first stage or with recompute outside a split backward."""
    s = c.s
    if sid == 0 or not get_spec(s.schedule).split_backward or recompute:
        return 0.0
    index, profile = c.unit_index, c.profile
    parts = [profile.units[index[n]] for n in units]
    first = parts[0]
    if sid == s.n_stages - 1 and first.split_suffix_bytes is not None:
        alone = sum(u.split_kept_bytes for u in parts)
        share = sum(u.split_kept_bytes * _tp_kept_share(c, u) for u in parts) / alone if alone else 1.0
        return first.split_suffix_bytes * share * c.act_scale
    kept = (first.split_kept_bytes * _tp_kept_share(c, first)
            + sum(u.split_after_bytes * _tp_kept_share(c, u) for u in parts[1:]))
    return kept * c.act_scale


def _tp_kept_share(c: _Context, u: UnitProfile) -> float:
    """The share of a unit's split-backward kept bytes (measured on one rank) one TP rank keeps: what is on no
    weight's path is the attention core and the activation between the split linears (a norm's or a linear's input
    is on its weight's path), which TP splits, or a vocabulary-split head's log-probabilities: 1/tp in a unit with
    those roles, all of it in a replicated one (a last stage's suffix weighs its units by their kept bytes alone). Checked with executor.activations
    (benchmarks/results/measurements.md, "Activation accuracy"): a last stage under SP comes out over, as what its
    head keeps under SP is not split out."""
    tu = u.tp
    if c.s.tp == 1 or tu is None or not (tu.saved_split or tu.saved_core or (tu.saved_logits and c.tp_vocab)):
        return 1.0
    return 1.0 / c.s.tp


def _stage(c: _Context, sid: int, unit_fb: list[tuple[float, float]]) -> StageEstimate:
    """One stage's per-micro-batch times, activation and p2p bytes; appends its units' (fwd, bwd) to unit_fb."""
    s, profile, units = c.s, c.profile, c.s.stages[sid]
    recompute = s.stage_recompute(sid)
    index = c.unit_index
    fwd = bwd = 0.0
    saved: list[float] = []
    acc = [0.0] * (len(TP_OPS) + 1)   # TP bytes per op, TP seconds
    ep_s = ep_fwd = ep_bytes = cp_s = cp_bytes = 0.0
    for name in units:
        f, b, kept, a2a_s, a2a_bytes, a2a_fwd, tp_acc = _unit_cost(c, name, recompute)
        ep_s, ep_fwd, ep_bytes = ep_s + a2a_s, ep_fwd + a2a_fwd, ep_bytes + a2a_bytes
        ctx = _cp_cost(c, name, recompute)
        f, b, kept = f + ctx.fwd_s, b + ctx.bwd_s, kept + ctx.kept
        cp_s, cp_bytes = cp_s + ctx.fwd_s * (2 if recompute else 1) + ctx.bwd_s, cp_bytes + ctx.bytes
        if tp_acc:
            acc = [x + y for x, y in zip(acc, tp_acc)]
        fwd, bwd = fwd + f, bwd + b
        saved.append(kept)
        unit_fb.append((f, b + (f if recompute else 0.0)))
    stage_input = _stage_input_bytes(c, index[units[0]])
    # Under a split backward a recomputed stage's I recomputes the units and W still needs what they saved, and the
    # stage keeps part of it to the step's end (_kept): measured well above the recompute model's peak
    # (benchmarks/results/measurements.md, "Activation accuracy"). Its memory is bounded by the unrecomputed
    # stage's instead.
    bounded = recompute and sid > 0 and get_spec(s.schedule).split_backward
    if recompute and not bounded:
        # Full recompute keeps each unit's input per micro-batch and one unit's working set at a time
        # (Korthikanti et al. 2022, section 4: 2sbh per layer in 16-bit instead of sbh(34 + 5as/h)).
        act = stage_input + sum(profile.units[index[n] - 1].output_bytes * c.act_scale for n in units[1:])
    else:
        act = sum(saved) * c.act_scale
    if recompute:
        bwd += fwd
    boundary = _boundary_bytes(profile, index[units[-1]]) * c.act_scale
    held = [_rank_params(c, n, units) for n in units]
    expert = sum(_expert_share(c, n) for n in units)
    send_f, send_b = _p2p_times(c, sid, boundary, stage_input)
    gather = _stage_gather(c, sum(held) - expert, expert)
    if s.n_stages > 1:
        # torch's schedule runtime costs a fixed amount per action (probed); a split backward runs as I and W
        per_action = action_cost(s, c.cluster)
        fwd, bwd = fwd + per_action, bwd + per_action * (2 if s.spec.split_backward else 1)
    if gathers_in_schedule(s):
        # FSDP2's per-unit work beyond compute and collectives (probed: overhead_probe.fsdp_unit_seconds) runs in
        # the stage's forward and backward hooks, so a pipeline waits for it on every stage in turn, not once after
        # the last: a stage's forward used about twice its unit compute in its thread's CPU time (measured:
        # benchmarks/results/measurements.md, "FSDP work inside pipeline stages"). Half on each side.
        fwd, bwd = fwd + c.overheads.fsdp_unit_s / 2, bwd + c.overheads.fsdp_unit_s / 2
    return StageEstimate(stage=sid, units=units, params=sum(held), fwd_s=fwd, bwd_s=bwd, activation_bytes=act,
                         boundary_bytes=boundary, peak_in_flight=0, send_fwd_s=send_f, send_bwd_s=send_b,
                         pp_rank=s.stage_rank(sid), largest_unit_params=max(held),
                         working_set_bytes=_working_set(c, units, saved, stage_input) if recompute and not bounded
                         else 0.0, tp_comm_s=acc[-1], kept_bytes=_kept(c, sid, units, recompute and not bounded),
                         tp_bytes=dict(zip(TP_OPS, acc)) if s.tp > 1 else {}, gather_s=gather,
                         gather_every_forward=gather > 0 and s.zero == 3, expert_params=expert, ep_comm_s=ep_s,
                         ep_fwd_s=ep_fwd, ep_bytes=ep_bytes, cp_comm_s=cp_s, cp_bytes=cp_bytes)


def _stage_gather(c: _Context, params: int, experts: int = 0) -> float:
    """Seconds of one all-gather of a pipeline stage's parameters over dp under ZeRO-2/3 (its routed experts'
    share under expert parallelism over their own group, dp / ep: _expert_coll), 0 otherwise.

    torch's pipeline stage is one FSDP unit, gathered by FSDP's pre-forward hook inside the stage's forward: after
    the stage received its input, so the gather sits on the pipeline's critical path, not after it. Counted per
    step with the executor's CommCounter (torch 2.13, gloo, gpt-tiny PP2 x DP2, GPipe and 1F1B at m = 1, 2, 4, and
    interleaved at v = 2): ZeRO-2 gathers each stage once; ZeRO-3 m + 1 times, once per forward and once more for
    the backward (the parameters then stay gathered to the step's end); a stage's forward + backward take that
    much longer than its compute (measured: benchmarks/results/measurements.md, "FSDP work inside pipeline
    stages"). The reduce-scatter comes after the stage's last backward and its sends (perform_reduce_grad), so
    it stays in the exposed time after the pipeline (_dp_pass). torch's schedule runtime (multi-stage schedules)
    issues the gathers ahead of the compute instead (UNSHARD actions, schedules._add_unshard_reshard), so there
    they stay in the exposed time too (with them on the path, interleaved ZeRO-2/3 priced too slow: same
    section)."""
    if not gathers_in_schedule(c.s):
        return 0.0
    t = _dp_coll(c)("all_gather", params * c.param_bytes)
    if experts:
        t += _expert_coll(c)("all_gather", experts * c.param_bytes)
    return t * c.calibration.dp_comm_scale


def gathers_in_schedule(s: Strategy) -> bool:
    """Whether the stages' FSDP gathers are simulated inside the pipeline schedule (_stage_gather)."""
    return s.n_stages > 1 and s.dp > 1 and s.zero >= 2 and not s.spec.multi_stage


def _dp_coll(c: _Context) -> CollFn:
    """collective_time over the strategy's dp group: its ranks are tp apart (mesh (pp, dp, tp)), so a node holds
    devices_per_node / tp of them."""
    s, cluster = c.s, c.cluster
    dp_rpn = group_ranks_per_node(cluster, n=s.dp, stride=s.tp)

    def coll(op: str, size: float, back_to_back: bool = False) -> float:
        return collective_time(cluster, op, size, s.dp, ranks_per_node=dp_rpn, back_to_back=back_to_back)
    return coll


def _expert_coll(c: _Context) -> CollFn:
    """collective_time over the routed experts' data-parallel group: the dp / ep ranks holding the same experts,
    ep x tp apart (cost.moe)."""
    s, cluster = c.s, c.cluster
    n = s.dp // s.ep
    rpn = group_ranks_per_node(cluster, n=n, stride=s.tp * s.ep)

    def coll(op: str, size: float, back_to_back: bool = False) -> float:
        return collective_time(cluster, op, size, n, ranks_per_node=rpn, back_to_back=back_to_back)
    return coll


def _p2p_times(c: _Context, sid: int, boundary: float, stage_input: float) -> tuple[float, float]:
    """p2p time of the stage's output to the next stage and of its input gradient to the previous one.
    A neighbour on the same rank (the turn of a V) is handed the tensor in memory: no p2p (torch's stage skips the
    send there)."""
    s, cluster = c.s, c.cluster
    here, per = s.stage_rank(sid), s.ranks_per_stage   # a pipeline rank's first global rank is pp_rank x dp x tp
    send_f = send_b = 0.0
    if sid < s.n_stages - 1 and s.stage_rank(sid + 1) != here:
        send_f = p2p_time(cluster, boundary, crosses_nodes=_crosses_nodes(here * per, s.stage_rank(sid + 1) * per,
                                                                          cluster))
    if sid > 0 and s.stage_rank(sid - 1) != here:
        send_b = p2p_time(cluster, stage_input, crosses_nodes=_crosses_nodes(here * per, s.stage_rank(sid - 1) * per,
                                                                             cluster))
    return send_f, send_b


def _stage_pass(c: _Context) -> tuple[tuple[StageEstimate, ...], list[tuple[float, float]]]:
    unit_fb: list[tuple[float, float]] = []   # per unit (forward, backward incl. recompute) of one micro-batch
    return tuple(_stage(c, sid, unit_fb) for sid in range(c.s.n_stages)), unit_fb


# --- pass 2: the pipeline -----------------------------------------------------------------------------------------

def _shared(c: _Context, stages: tuple[StageEstimate, ...]) -> tuple[StageEstimate, ...]:
    """A pipeline's stages on CPU ranks that share cores, each action priced at the ranks busy while it runs
    (sharing.stretches) instead of at the step's average (busy_ranks). Everything in an action's fwd_s / bwd_s is
    CPU work on these ranks (the units, torch's per-action runtime, FSDP's hooks), so all of it is stretched; its
    gathers (gather_s, priced by the probe's collective fits) are not (the rounds' own simulations stretch a ZeRO-3
    stage's every-forward gather with its forward, which moved a PP2 x DP2 ZeRO-3 step by 0.03%). Scored offline
    against fidelity measurements, it brought pipelines of one micro-batch closer to measured
    (benchmarks/results/measurements.md, "Processor sharing in a pipeline step"). GPUs, and pipelines of one
    stage, as priced."""
    s, cores = c.s, c.sharing.cores
    if cores is None or s.n_stages == 1:
        return stages
    out = stretches(s.simulated_schedule, s.pp, s.microbatches, s.v, tuple(st.cost() for st in stages),
                    replicas=s.ranks_per_stage, cores=cores, priced_at=c.sharing.contention,
                    send_delay_s=c.sharing.send_delay_s)
    shared = []
    for st, x in zip(stages, out):
        bwd, frac = stretched_backward(st.bwd_s, st.bwd_input_fraction, x)
        shared.append(dataclasses.replace(st, fwd_s=st.fwd_s * x.fwd, bwd_s=bwd, bwd_input_fraction=frac))
    return tuple(shared)


def _pipeline_pass(s: Strategy, stages: tuple[StageEstimate, ...], *, compact: bool,
                   send_delay_s: float = 0.0) -> tuple[Simulation, Simulation]:
    """The schedule simulated with p2p, and (unless compact) again with free p2p to split bubble from p2p time.
    `send_delay_s`: how long CPU ranks' gloo sends may wait for the sender's next wait (simulator._evaluate,
    send_delay). The free run keeps that wait: it is compute on the sender's side, so it counts as bubble, and p2p
    is the transfers alone."""
    costs = tuple(st.cost() for st in stages)
    sim = simulate_schedule(s.simulated_schedule, s.pp, s.microbatches, s.v, costs, send_delay_s=send_delay_s)
    if compact:
        return sim, sim
    free = tuple(dataclasses.replace(x, send_fwd_s=0.0, send_bwd_s=0.0) for x in costs)
    return sim, simulate_schedule(s.simulated_schedule, s.pp, s.microbatches, s.v, free, send_delay_s=send_delay_s)


def _rank_stages(s: Strategy, stages: tuple[StageEstimate, ...], r: int) -> list[StageEstimate]:
    return [stages[sid] for sid in s.rank_stages(r)]


# --- pass 3: data-parallel exposure -------------------------------------------------------------------------------

def _dp_pass(c: _Context, stages: tuple[StageEstimate, ...], unit_fb: list[tuple[float, float]]
             ) -> tuple[list[float], dict[str, float]]:
    """Each pipeline rank's exposed data-parallel time per step, and pipeline rank 0's bytes per collective op."""
    s, cluster = c.s, c.cluster
    coll = _dp_coll(c)
    dp_bytes: dict[str, float] = {}
    rank_dp: list[float] = []
    experts_s = _experts_dp(c)
    for r in range(s.pp):
        mine = _rank_stages(s, stages, r)
        units = [(_rank_params(c, n, st.units) - _expert_share(c, n),
                  c.profile.unit(n).param_tensors - (_expert_tensors(c, n))) for st in mine for n in st.units]
        experts = [(_expert_share(c, n), _expert_tensors(c, n)) for st in mine for n in st.units]
        exposed = 0.0
        groups = [(s, coll, units, [st.params - st.expert_params for st in mine])]
        if experts_s is not None:   # the routed experts' over their own data-parallel group (cost.moe)
            groups.append((experts_s, _expert_coll(c), experts, [st.expert_params for st in mine]))
        for strategy, group_coll, group_units, stage_params in groups:
            for op, count, size, back_to_back in _dp_collectives(strategy, group_units, stage_params, c.param_bytes,
                                                                 c.grad_bytes, by_hand=s.ep > 1):
                if not (op == "all_gather" and gathers_in_schedule(s)):   # in the stages' costs (_stage_gather)
                    exposed += count * group_coll(op, size, back_to_back)
                if r == 0:
                    dp_bytes[op] = dp_bytes.get(op, 0.0) + count * size
        if s.gathers_per_unit and not gathers_in_schedule(s):
            # FSDP2's per-unit work beyond compute and collective latency (probed), every micro-batch: one unit per
            # pipeline unit without a pipeline, one per stage with one (in the stages' costs where the pipeline
            # schedule holds their gathers: _stage)
            fsdp_units = len(units) if s.pp == 1 else len(mine)
            if experts_s is not None:   # each block's experts are an FSDP unit of their own (executor.zero.wrap)
                fsdp_units += sum(1 for e, _ in experts if e)
            exposed += s.microbatches * fsdp_units * c.overheads.fsdp_unit_s
        if cluster.device.kind == "gpu" and s.pp == 1 and s.dp > 1 and not (s.ep > 1 and s.zero <= 1):
            shares = [_expert_share(c, u.name) for u in c.profile.units]
            params = [(u.params if s.tp == 1 else tp_param_share(u.params, u.tp, s.tp, c.tp_vocab))
                      - (u.moe.expert_params if u.moe and e else 0) for u, e in zip(c.profile.units, shares)]
            tensors = [max(1, u.param_tensors - _expert_tensors(c, u.name)) for u in c.profile.units]
            exposed = _overlapped_dp_time(s, params, tensors, unit_fb, coll, c.param_bytes, c.grad_bytes)
            if experts_s is not None:   # hidden behind the same compute as the dense ones: counted apart, at worst
                exposed += _overlapped_dp_time(experts_s, [float(e) for e in shares],
                                               [max(1, _expert_tensors(c, u.name)) for u in c.profile.units],
                                               unit_fb, _expert_coll(c), c.param_bytes, c.grad_bytes)
        rank_dp.append(exposed * c.calibration.dp_comm_scale)
    return rank_dp, dp_bytes


def _expert_tensors(c: _Context, unit: str) -> int:
    """The routed experts' parameter tensors of `unit` under expert parallelism (each rank holds a slice of every
    one: its E / ep experts), 0 without it."""
    moe = c.profile.unit(unit).moe
    return moe.expert_tensors if moe is not None and c.s.ep > 1 else 0


def _experts_dp(c: _Context) -> Strategy | None:
    """The strategy as the routed experts' data-parallel group runs it (dp / ep ranks, the same ZeRO stage), or
    None where that group is one rank (or there is no expert parallelism)."""
    s = c.s
    if s.ep == 1 or s.dp // s.ep == 1:
        return None
    return dataclasses.replace(s, dp=s.dp // s.ep, ep=1)


# --- pass 4: the optimizer ----------------------------------------------------------------------------------------

def _optimizer_pass(c: _Context, stages: tuple[StageEstimate, ...]) -> float:
    """The busiest pipeline rank's optimizer step: its parameters' update plus a per-tensor overhead (probed)."""
    s = c.s
    per_rank = [_rank_stages(s, stages, r) for r in range(s.pp)]
    # ZeRO-1-3 split the optimizer states over the data-parallel group: dp for dense parameters, dp / ep for the
    # routed experts' (their own group under expert parallelism)
    dense_dp, expert_dp = (s.dp, s.dp // s.ep) if s.zero >= 1 else (1, 1)
    opt_params_rank = max(sum((st.params - st.expert_params) / dense_dp + st.expert_params / expert_dp for st in mine)
                          for mine in per_rank)
    opt_tensors = max(sum(max(1, c.profile.unit(n).param_tensors) for st in mine for n in st.units)
                      for mine in per_rank)
    # FSDP2 keeps a shard of every tensor on every rank; ZeroRedundancyOptimizer gives each rank whole tensors
    opt_tensors_rank = opt_tensors / (s.dp if s.zero == 1 and not s.distributed_optimizer else 1)
    # FSDP2's shards (ZeRO-2/3) and a TP model's parameters are DTensors: every op of their update is dispatched
    # by DTensor, about ten times a plain tensor's cost (measured: benchmarks/results/measurements.md, "DTensor
    # optimizer overhead")
    return optimizer_seconds(opt_params_rank, opt_tensors_rank, profile=c.profile, cluster=c.cluster,
                             precision=s.precision, optimizer=s.optimizer, ranks_running=c.sharing.busy,
                             dtensors=s.gathers_per_unit or s.tp > 1)


def optimizer_seconds(params: float, tensors: float, *, profile: ModelProfile, cluster: ClusterProfile,
                      precision: str, optimizer: str, ranks_running: float, dtensors: bool) -> float:
    """One rank's optimizer step as the estimate prices it (_optimizer_pass): the update of `params` parameters on
    one of `ranks_running` busy ranks plus the probe's fixed cost per tensor for `tensors` tensors (DTensor's where
    `dtensors` and the probe measured it), scaled by the cluster's calibration. The planner's time bound passes no
    tensors (planner.search._point_bound)."""
    probe = cluster.compute or _NO_OVERHEADS
    per_tensor = probe.optimizer_dtensor_s if dtensors and probe.optimizer_dtensor_s > 0 else probe.optimizer_tensor_s
    return (cluster.calibration or Calibration()).optimizer_scale * (
        optimizer_step_time(params, profile=profile, cluster=cluster, precision=precision, optimizer=optimizer,
                            ranks_running=ranks_running) + tensors * per_tensor)


# --- pass 5: throughput and traffic -------------------------------------------------------------------------------

def _throughput(c: _Context, total: float) -> tuple[int, str, float | None, float | None]:
    """(tokens or samples per step, which of the two, MFU, HFU) over step time x devices x dense peak (GPUs only).
    MFU counts model FLOPs as PaLM does (Chowdhery et al. 2022, appendix B: 6N + 12LHQT per token, i.e. three times
    the forward's matmul and attention FLOPs: backward = 2 x forward, no recompute). HFU counts what the devices run
    (hardware_flops_per_step): the profile's measured backward (torch's attention backward recomputes QK^T: 2.5 x
    its forward) and the recomputed forwards. HFU is usually the higher (a first layer whose input needs no gradient
    runs less backward than PaLM's 2 x forward)."""
    s, profile, cluster = c.s, c.profile, c.cluster
    per_sequence = counts_positions(profile.input.kind)
    tokens = s.global_batch_size * items_per_sequence(profile.input.kind, profile.seq_len)
    per_sample = s.global_batch_size / profile.micro_batch_size
    model_flops = 3 * sum(u.fwd_flops for u in profile.units) * per_sample
    peak = cluster.device.peak_flops.get(compute_dtype(s.precision))
    if not (peak and total > 0 and cluster.device.kind == "gpu"):
        return tokens, "tokens" if per_sequence else "samples", None, None
    denom = total * s.world_size * peak
    return (tokens, "tokens" if per_sequence else "samples", model_flops / denom,
            hardware_flops_per_step(s, profile) / denom)


def hardware_flops_per_step(s: Strategy, profile: ModelProfile) -> float:
    """FLOPs the devices run per step: each unit's profiled forward + backward (FlopCounterMode, torch's own
    backward formulas), plus its forward again in a fully recomputed stage, plus the attention core's forward under
    selective recompute (Korthikanti et al. 2022, section 5)."""
    flops = 0.0
    for sid, units in enumerate(s.stages):
        full = s.stage_recompute(sid)
        for name in units:
            u = profile.unit(name)
            again = u.fwd_flops if full else (u.tp.core_flops if s.selective and u.tp is not None else 0)
            flops += u.fwd_flops + u.bwd_flops + again
    return flops * s.global_batch_size / profile.micro_batch_size


def _comm_volume(c: _Context, stages: tuple[StageEstimate, ...], dp_bytes: dict[str, float]) -> CommVolume:
    s, cluster = c.s, c.cluster
    # boundaries between ranks: the same-rank turn of a V moves nothing
    between = [i for i in range(s.n_stages - 1) if s.stage_rank(i) != s.stage_rank(i + 1)]
    p2p_bytes = sum(2 * stages[i].boundary_bytes for i in between) * s.microbatches
    per = s.ranks_per_stage
    crossing = sum(_crosses_nodes(s.stage_rank(i) * per, s.stage_rank(i + 1) * per, cluster) for i in between)
    p2p_link = f"{crossing} of {len(between)} stage boundaries inter-node" if s.n_stages > 1 else "none"
    dp_link = "inter-node" if s.ranks_per_stage > cluster.devices_per_node else "intra-node"
    tp_bytes = _tp_step_bytes(s, stages, 0)
    tp_link = "none" if s.tp == 1 else "intra-node" if s.tp <= cluster.devices_per_node else "inter-node"
    return CommVolume(p2p_bytes_per_step=p2p_bytes, dp_bytes_per_rank=sum(dp_bytes.values()), dp_collectives=dp_bytes,
                      p2p_link=p2p_link, dp_link=dp_link, tp_bytes_per_rank=sum(tp_bytes.values()),
                      tp_collectives=tp_bytes, tp_link=tp_link,
                      ep_link=group_link(cluster, n=s.ep, stride=s.tp),
                      ep_bytes_per_rank=s.microbatches * sum(st.ep_bytes for st in stages) / s.pp,
                      cp_bytes_per_rank=s.microbatches * sum(st.cp_bytes for st in stages) / s.pp,
                      cp_link=group_link(cluster, n=c.cp, stride=s.tp))


def _tp_step_bytes(s: Strategy, stages: tuple[StageEstimate, ...], pp_rank: int) -> dict[str, float]:
    """Full-buffer bytes per TP collective op one rank of pipeline rank `pp_rank` moves per step."""
    if s.tp == 1:
        return {}
    mine = _rank_stages(s, stages, pp_rank)
    return {op: s.microbatches * sum(st.tp_bytes.get(op, 0.0) for st in mine) for op in TP_OPS}


# --- the estimate -------------------------------------------------------------------------------------------------

def executed(strategy: Strategy, cluster: ClusterProfile) -> Strategy:
    """The strategy as the executor runs it: CPU ranks run every plan in fp32 (executor.zero.mixed_precision), so a
    bf16-mixed plan on CPU ranks is priced, and its bytes counted, as fp32 (it measured 2x the bf16 bytes)."""
    run = executed_precision(strategy.precision, cluster.device.kind)
    return dataclasses.replace(strategy, precision=run) if run != strategy.precision else strategy


def estimate(strategy: Strategy, profile: ModelProfile, cluster: ClusterProfile, *, compact: bool = False,
             per_rank: bool | None = None) -> Estimate:
    """Predict one training step of `strategy` (validated against the profile's units) on `cluster`.

    compact=True is for ranking many candidates: the same step time and fit, but no separate bubble / p2p split
    (one simulation instead of two; bubble_s holds both) and one memory entry per pipeline rank instead of one
    per global rank. Reports and plan files use full estimates. per_rank (default: not compact) chooses the
    listings alone: one memory entry per global rank and every rank's action order, or neither (they grow with
    dp x pp and m x pp x v; a plan's alternatives need the split, not the listings)."""
    per_rank = not compact if per_rank is None else per_rank
    profile = cp_origin(profile)   # the search costs context-parallel points on their view of the profile
    s = executed(strategy, cluster)
    s.validate(tuple(u.name for u in profile.units))
    why = check_ep(profile, s.ep) or cp_refusal(profile, s.cp)
    if why:
        raise ConfigError(why)
    priced = priced_digest(s, model=profile.name, source=profile.source, seq_len=profile.seq_len,
                           units=[u.name for u in profile.units])
    cp = s.cp
    s, profile = s.data_view(), cp_view(profile, cp) if cp > 1 else profile
    c = _Context.of(s, profile, cluster, cp)
    stages, unit_fb = _stage_pass(c)
    stages = _shared(c, stages)
    sim, free = _pipeline_pass(s, stages, compact=compact, send_delay_s=c.sharing.send_delay_s)
    rank_dp, dp_bytes = _dp_pass(c, stages, unit_fb)
    rank_end, tied_bytes = _tied_sync(c, [sim.finish_s.get(r, 0.0) + rank_dp[r] for r in range(s.pp)])
    optimizer_s = _optimizer_pass(c, stages)
    total = max(rank_end) + optimizer_s
    critical = max(range(s.pp), key=lambda r: rank_end[r])
    breakdown = StepBreakdown(
        compute_s=sim.busy_s[critical], bubble_s=max(0.0, free.makespan_s - free.busy_s[critical]),
        p2p_s=max(0.0, sim.makespan_s - free.makespan_s),
        dp_comm_s=rank_end[critical] - sim.finish_s.get(critical, 0.0), optimizer_s=optimizer_s,
        total_s=total, tp_comm_s=s.microbatches * sum(st.tp_comm_s for st in _rank_stages(s, stages, critical)),
        ep_comm_s=s.microbatches * sum(st.ep_comm_s for st in _rank_stages(s, stages, critical)),
        cp_comm_s=s.microbatches * sum(st.cp_comm_s for st in _rank_stages(s, stages, critical)))
    stages = tuple(dataclasses.replace(st, peak_in_flight=sim.peak_in_flight.get(st.stage, 0)) for st in stages)
    memory = _memory(c, stages, sim, per_rank=per_rank)
    tokens, unit, mfu, hfu = _throughput(c, total)
    return Estimate(
        step_time_s=total, breakdown=breakdown, bubble_ratio=free.bubble_ratio, bubble_share=free.bubble_share,
        tokens_per_step=tokens, tokens_per_s=tokens / total if total > 0 else 0.0, throughput_unit=unit, mfu=mfu, hfu=hfu,
        stages=stages, memory_per_rank=memory, capacity_bytes=cluster.device.memory_bytes,
        fits=max(m.total_bytes for m in memory) <= cluster.device.memory_bytes,
        comm=dataclasses.replace(_comm_volume(c, stages, dp_bytes), tied_bytes_per_rank=tied_bytes),
        compute_source=compute_source(profile, cluster, s.precision),
        pipeline_order=format_order(s.action_order()) if per_rank else {},
        calibrated_by=cluster.calibration.describe() if cluster.calibration else "", priced=priced,
        ep_load=busiest_load(profile, s.ep), ep_peak_load=busiest_peak_load(profile, s))


def tp_bytes_per_step(strategy: Strategy, profile: ModelProfile, *, pp_rank: int = 0) -> dict[str, float]:
    """Bytes one rank of pipeline rank `pp_rank` moves per step in tensor-parallel collectives, keyed as the
    executor's CommCounter counts DTensor's collectives ("tp_all_reduce", "tp_all_gather", "tp_reduce_scatter"), in
    the full-buffer convention of CommVolume.dp_bytes_per_rank: an all-reduce's tensor, an all-gather's output, a
    reduce-scatter's input. Forward collectives run again in a fully recomputed stage's backward; selective
    recompute repeats none (the executor saves the collectives' outputs). {} without tensor parallelism."""
    return {op: size for op, (_, size) in tp_traffic_per_step(strategy, profile, pp_rank=pp_rank).items()}


def tp_traffic_per_step(strategy: Strategy, profile: ModelProfile, *,
                        pp_rank: int = 0) -> dict[str, tuple[float, float]]:
    """tp_bytes_per_step's collectives as (calls, bytes) per kind."""
    s = strategy
    if s.tp == 1:
        return {}
    shape = profile.tensor_parallel
    vocab = shape.vocab if shape and vocab_divides(shape, s.tp) else 0
    scale = activation_scale(profile, micro_batch_size=s.micro_batch_size, precision=s.precision)
    grad_bytes = BYTES_PER_PARAM[(s.precision, s.optimizer)][1]
    out = {op: [0.0, 0.0] for op in TP_OPS}
    for sid in s.rank_stages(pp_rank):
        passes = 2 if s.stage_recompute(sid) else 1
        for name in s.stages[sid]:
            tu = profile.unit(name).tp
            if tu is None:
                continue
            fwd, bwd = tp_unit_traffic(tu, sp=s.sp, vocab=vocab, save_shard=s.sp_save_shard and passes == 1)
            norms = norm_grad_traffic(tu, grad_bytes, sp=s.sp)
            for i, op in enumerate(TP_OPS):
                out[op][0] += (passes * fwd[2 * i] + bwd[2 * i] + norms[2 * i]) * s.microbatches
                out[op][1] += ((passes * fwd[2 * i + 1] + bwd[2 * i + 1]) * scale + norms[2 * i + 1]) * s.microbatches
    return {f"tp_{op}": (calls, size) for op, (calls, size) in out.items()}


DDP_BUCKET_BYTES = 25 * 2**20   # DistributedDataParallel's default bucket_cap_mb


def _tied_sync(c: _Context, rank_end: list[float]) -> tuple[list[float], float]:
    """Each pipeline rank's end after the all-reduce of tied gradients (GPT-2's embedding and LM head on different
    ranks): the executor (runtime.forward_backward) all-reduces each tied parameter's local gradient (a ZeRO-2/3
    shard) over the pipeline ranks holding it, after the data-parallel syncs, so the call starts when the last of
    them gets there: one call while its ranks run nothing else, priced by the probe's all-reduce fit (comm's
    `alone`; measured: benchmarks/results/measurements.md, "Tied-gradient all-reduce"). Also returns the bytes
    pipeline rank 0 all-reduces so."""
    s, cluster = c.s, c.cluster
    out = list(rank_end)
    rank0_bytes = 0.0
    per = s.ranks_per_stage   # a pipeline rank's first global rank is pp_rank x dp x tp
    for shared in c.profile.shared:
        ranks = sorted({s.stage_rank(sid) for sid, units in enumerate(s.stages) if set(units) & set(shared.units)})
        if len(ranks) < 2:
            continue
        # a ZeRO-2/3 shard; a TP rank's share where the vocabulary splits (_rank_params)
        size = shared.numel * c.grad_bytes / (s.dp if s.zero >= 2 else 1) / (s.tp if c.tp_vocab else 1)
        spread = _crosses_nodes(ranks[0] * per, ranks[-1] * per, cluster)
        t = collective_time(cluster, "all_reduce", size, len(ranks), ranks_per_node=1 if spread else None, alone=True)
        end = max(out[r] for r in ranks) + t * c.calibration.dp_comm_scale
        for r in ranks:
            out[r] = end
        rank0_bytes += size if ranks[0] == 0 else 0.0
    return out, rank0_bytes


def _dp_collectives(s: Strategy, units: list[tuple[int, int]], stage_params: list[int], p_b: int,
                    g_b: int, *, by_hand: bool = False) -> list[tuple[str, int, float, bool]]:
    """(op, times per step, full buffer bytes, back to back) of every collective one pipeline rank's dp group
    issues per step, as the executor issues them (module doc): each message pays the latency alpha, so the count
    matters as much as the bytes. Per-tensor all-reduces (all_reduce_grads) go back to back, with no compute
    between them (CollectiveFit.predict). `units` holds (parameters, parameter
    tensors) of the units on this rank, `stage_params` the parameters of each of its stages. `by_hand`: ZeRO-0/1
    gradients all-reduced per tensor after backward without a pipeline too (expert parallelism's, executor.zero)."""
    if s.dp == 1:
        return []
    m, pipelined = s.microbatches, s.pp > 1
    total = sum(n for n, _ in units)
    tensors = [(n / max(1, t), max(1, t)) for n, t in units]   # (elements per tensor, tensors) per unit
    out: list[tuple[str, int, float, bool]] = []
    if s.distributed_optimizer:   # each unit gathered once and reduce-scattered once per step, in fp32
        return [(op, 1, n * b, False) for op, b in (("all_gather", p_b), ("reduce_scatter", DTYPE_BYTES["fp32"]))
                for n, _ in units]
    if s.zero <= 1:
        if pipelined or by_hand:   # all_reduce_grads: one all-reduce per parameter tensor
            out += [("all_reduce", count, size * g_b, True) for size, count in tensors]
        else:           # DDP: one all-reduce per gradient bucket, as backward reaches it
            buckets = max(1, math.ceil(total * g_b / DDP_BUCKET_BYTES))
            out.append(("all_reduce", buckets, total * g_b / buckets, False))
        if s.zero == 1:  # ZeroRedundancyOptimizer broadcasts every updated parameter tensor from its owner, async;
            # the probe times broadcasts as such a run already (cluster_probe._broadcast_run), so its mean is
            # their cost: the medians' line is for calls timed one at a time
            out += [("broadcast", count, size * p_b, False) for size, count in tensors]
        return out
    if pipelined:   # one FSDP unit per stage, gathered as _stage_gather counts, reduce-scattered once per step
        gathers = m + 1 if s.zero == 3 else 1
        return [(op, count, n * b, False) for n in stage_params
                for op, count, b in (("all_gather", gathers, p_b), ("reduce_scatter", 1, g_b))]
    gathers = 2 * m if s.zero == 3 else m
    # without a pipeline every unit is its own FSDP unit, gathered and reduce-scattered every micro-batch
    return [(op, count, n * b, False) for op, count, b in (("all_gather", gathers, p_b), ("reduce_scatter", m, g_b))
            for n, _ in units]


def _overlapped_dp_time(s: Strategy, params: list[float], tensors: list[int], unit_fb: list[tuple[float, float]],
                        coll: CollFn, p_b: int, g_b: int) -> float:
    """Exposed data-parallel time without a pipeline on GPUs, where NCCL runs beside compute.

    FSDP2 wraps each unit and prefetches one unit ahead (Zhao et al. 2023, "PyTorch FSDP", section 3.3): the
    gather of unit u hides behind the forward of unit u-1 (the first unit's cannot hide), and in backward the
    gather and reduce-scatter of unit u behind its backward. DDP all-reduces gradient buckets while the last
    micro-batch's backward runs; ZeroRedundancyOptimizer broadcasts the updated tensors after the step, one call
    per tensor (exposed). What hides still slows the compute beside it (comm.overlapped_exposure). `params`: each
    unit's parameters on one rank (its TP share), in `tensors` tensors.
    """
    m, hide = s.microbatches, overlapped_exposure
    if s.distributed_optimizer:   # gathered ahead of the first micro-batch's forward, reduce-scattered in fp32
        gather = [coll("all_gather", n * p_b) for n in params]   # during the last one's backward, per unit
        reduce = [coll("reduce_scatter", n * DTYPE_BYTES["fp32"]) for n in params]
        return (gather[0] + sum(hide(gather[u], unit_fb[u - 1][0]) for u in range(1, len(params)))
                + sum(hide(reduce[u], unit_fb[u][1]) for u in range(len(params))))
    if s.zero <= 1:
        ar = coll("all_reduce", sum(params) * g_b)
        exposed = hide(ar, sum(b for _, b in unit_fb))
        if s.zero != 1:
            return exposed
        return exposed + sum(t * coll("broadcast", n / t * p_b) for n, t in zip(params, tensors) if n)
    gather = [coll("all_gather", n * p_b) for n in params]
    reduce = [coll("reduce_scatter", n * g_b) for n in params]
    fwd = gather[0] + sum(hide(gather[u], unit_fb[u - 1][0]) for u in range(1, len(params)))
    if s.zero == 2:   # gathered once per micro-batch, kept through backward; gradients reduce-scattered per unit
        bwd = sum(hide(reduce[u], unit_fb[u][1]) for u in range(len(params)))
    else:             # ZeRO-3 gathers again for backward
        bwd = sum(hide(gather[u] + reduce[u], unit_fb[u][1]) for u in range(len(params)))
    return m * (fwd + bwd)


def _memory(c: _Context, stages: tuple[StageEstimate, ...], sim: Simulation, *,
            per_rank: bool = True) -> tuple[MemoryBreakdown, ...]:
    """Per-rank memory: model states by ZeRO stage over the rank's stages, the simulated activation peak, buffers."""
    s = c.s
    per_pp_rank = [_pp_rank_memory(c, _rank_stages(s, stages, r), sim.peak_activation_bytes.get(r, 0.0))
                   for r in range(s.pp)]
    out = []
    # mesh (pp, dp, tp): the tp ranks of a dp rank hold equal shares; compact: one entry per pipeline rank
    for rank in (range(s.world_size) if per_rank else range(0, s.world_size, s.ranks_per_stage)):
        pp_rank, d, _ = s.coords(rank)
        base, shares = per_pp_rank[pp_rank]
        o = base.optimizer_states
        if shares is not None:   # ZeroRedundancyOptimizer's uneven split (the compact form keeps the largest);
            # dp ranks past the tensor count own no tensor (zero1_partition)
            o = (shares[d] if d < len(shares) else 0) if per_rank else max(shares)
        out.append(dataclasses.replace(base, rank=rank, optimizer_states=int(o)))
    return tuple(out)


def _pp_rank_memory(c: _Context, mine: list[StageEstimate],
                    peak_activations: float) -> tuple[MemoryBreakdown, list[int] | None]:
    """A pipeline rank's memory (optimizer states split evenly over dp), and with ZeRO-1 each dp rank's share of the
    optimizer states as ZeroRedundancyOptimizer splits whole tensors (None otherwise)."""
    s = c.s
    params = sum(st.params for st in mine)
    largest = max(st.largest_unit_params for st in mine)
    # the distributed optimizer holds shards as ZeRO-2's FSDP2 does, and the whole parameters and gradients
    # through the step as a pipeline's FSDP2 stages do (comm_buffer_bytes)
    zero = 2 if s.distributed_optimizer else s.zero
    experts = sum(st.expert_params for st in mine)
    p, g, o = executor_state_bytes(params - experts, s.dp, zero, s.precision, s.optimizer, mixed=c.mixed)
    if experts:   # the routed experts' states, ZeRO-sharded over their own group (dp / ep ranks: cost.moe)
        p, g, o = (a + b for a, b in zip((p, g, o), executor_state_bytes(
            experts, s.dp // s.ep, zero, s.precision, s.optimizer, mixed=c.mixed)))
    buffers = comm_buffer_bytes(stage_params=params, largest_unit_params=largest, zero=zero, pp=s.pp, dp=s.dp,
                                param_bytes=c.param_bytes, grad_bytes=c.grad_bytes,
                                held_whole=s.distributed_optimizer)
    buffers += autocast_copy_bytes(params, autocast=c.autocast)
    # the largest transient of its units (profile.UnitProfile.transient_bytes, measured on GPUs): an LM head's
    # backward runs while every micro-batch in flight still holds its activations. Under tensor parallelism taken
    # as split tp ways (the vocabulary-split head's logits, the column-split MLP's intermediate): an approximation
    buffers += max(c.profile.unit(u).transient_bytes for st in mine for u in st.units) * c.act_scale / s.tp
    activations = peak_activations + max(st.working_set_bytes for st in mine)
    shares = None
    numels = [n for st in mine for u in st.units
              for n in _unit_numels(c.profile, u, st.units, tp=s.tp, vocab=c.tp_vocab)]
    if s.zero == 1 and not s.distributed_optimizer and s.dp > 1 and numels and s.ep == 1:
        k_b = held_bytes_per_param(s.precision, s.optimizer, mixed=c.mixed)[2]
        shares = [k_b * n for n in zero1_partition(numels, s.dp)]
    base = MemoryBreakdown(rank=0, stages=tuple(st.stage for st in mine), parameters=int(p), gradients=int(g),
                           optimizer_states=int(o), activations=int(activations), buffers=int(buffers),
                           overhead=int(overhead_bytes(c.cluster)))
    return base, shares
