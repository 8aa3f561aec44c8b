"""estimate(strategy, model profile, cluster) -> Estimate: step time with its breakdown and per-rank memory.

Step time = the pipeline's makespan, simulated with each stage's per-micro-batch times and p2p transfers
(cost_models.schedule), split into compute, bubble and exposed p2p; plus each rank's exposed data-parallel
collectives after its last backward; plus the optimizer step. Data-parallel traffic per step follows what the
executor runs (ZeRO paper, section 7: 2Ψ for stages 0-2, 3Ψ for stage 3, per gathered micro-batch):
    ZeRO-0  all-reduce of gradients (DDP, no_sync until the last micro-batch)
    ZeRO-1  all-reduce of gradients + all-gather of updated parameters (ZeroRedundancyOptimizer's broadcasts)
    ZeRO-2  without a pipeline, FSDP2 gathers and reduce-scatters every micro-batch; in a pipeline torch's stage
            defers both to once per step
    ZeRO-3  FSDP2 gathers parameters for every micro-batch's forward and again for its backward; gradients are
            reduce-scattered every micro-batch without a pipeline, once per step in one
Overlap: without a pipeline on GPUs, FSDP2's one-unit-ahead prefetch and DDP's bucketed all-reduce hide
communication behind compute unit by unit (see _overlapped_dp_time); what does not fit is exposed. With a
pipeline, each stage is one FSDP unit and torch's stage runs its gathers and the final reduction outside the
compute, so they are exposed. CPU ranks share their cores with gloo's threads: nothing is assumed hidden there.
"""
from __future__ import annotations

import math

from cost_models.cluster import ClusterProfile, ComputeProbe
from cost_models.comm import collective_time, p2p_time
from cost_models.compute import optimizer_step_time, unit_times, uses_measured_times
from cost_models.memory import (BYTES_PER_PARAM, OVERHEAD_BYTES, MemoryBreakdown, comm_buffer_bytes,
                                 executor_state_bytes, zero1_partition)
from cost_models.profile import ModelProfile
from cost_models.records import Record, record
from cost_models.schedule import StageCost, cached_order, format_order, simulate_schedule, stage_to_rank
from cost_models.strategy import Strategy

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# presets carry no probe: no per-call overheads are assumed there (GPU launches mostly hide behind kernels)
_NO_OVERHEADS = ComputeProbe(dtype="", matmul_n=0, ranks=1, threads_per_rank=1, flops_per_rank=0.0, flops_alone=0.0)


@record
class StepBreakdown(Record):
    compute_s: float        # the critical rank's forward + backward (+ recompute) over all micro-batches
    bubble_s: float         # pipeline idle time on that rank with free p2p
    p2p_s: float            # makespan added by p2p transfers
    dp_comm_s: float        # exposed data-parallel collectives
    optimizer_s: float
    total_s: float


@record
class StageEstimate(Record):
    stage: int
    units: tuple[str, ...]
    params: int             # parameters the stage holds (a tied parameter counts in every stage that uses it)
    fwd_s: float            # per micro-batch
    bwd_s: float            # per micro-batch, incl. recompute
    activation_bytes: float # kept per micro-batch in flight
    boundary_bytes: float   # what it sends to the next stage per micro-batch
    peak_in_flight: int
    send_fwd_s: float = 0.0 # p2p time of its output to the next stage (per micro-batch)
    send_bwd_s: float = 0.0 # p2p time of its input gradient to the previous stage

    def cost(self) -> StageCost:
        """The simulator's view of this stage (reports re-simulate the plan's timeline from it)."""
        return StageCost(fwd_s=self.fwd_s, bwd_s=self.bwd_s, send_fwd_s=self.send_fwd_s, send_bwd_s=self.send_bwd_s,
                         activation_bytes=self.activation_bytes)


@record
class CommVolume(Record):
    p2p_bytes_per_step: float        # activations + gradients crossing stage boundaries, one pipeline
    dp_bytes_per_rank: float         # bytes each rank moves in data-parallel collectives per step (full buffers)
    dp_collectives: dict[str, float] # op -> bytes per rank per step
    p2p_link: str
    dp_link: str


@record
class Estimate(Record):
    step_time_s: float
    breakdown: StepBreakdown
    bubble_ratio: float      # (makespan - ideal) / ideal, Narayanan et al.'s (p-1)/m convention
    bubble_share: float      # idle share of all rank-time in the pipeline
    tokens_per_step: int     # tokens (sequences x seq_len) for token and feature-sequence inputs; samples for others
    tokens_per_s: float
    throughput_unit: str = "tokens"   # what tokens_* count: "tokens" | "samples" (an input with no sequence axis)
    mfu: float | None        # model FLOPs / (step time x world x peak); None where the peak is unknown
    stages: tuple[StageEstimate, ...]
    memory_per_rank: tuple[MemoryBreakdown, ...]
    capacity_bytes: int
    fits: bool
    comm: CommVolume
    compute_source: str      # "measured" (profile times on this device kind) | "flops" (FLOPs / peak x efficiency)
    pipeline_order: dict[str, list[str]]

    @property
    def peak_memory_bytes(self) -> int:
        return max(m.total_bytes for m in self.memory_per_rank)


def _stage_params(profile: ModelProfile, units: tuple[str, ...]) -> tuple[int, int]:
    """(parameters held, largest unit's parameters) of a stage; tied parameters count in each stage using them."""
    held = [profile.unit(n).params + _shared_numel(profile, n, units) for n in units]
    return sum(held), max(held)


def _shared_numel(profile: ModelProfile, unit: str, stage_units) -> int:
    """Elements of tied parameters `unit` uses whose owning unit is in another stage (this stage holds a copy)."""
    extra = 0
    for alias in profile.unit(unit).shared_params:
        shared = next((sp for sp in profile.shared if alias in sp.aliases), None)
        if shared is not None and shared.units[0] not in stage_units:
            extra += shared.numel
    return extra


def _boundary_bytes(profile: ModelProfile, stages, sid: int, unit_index: dict[str, int]) -> float:
    """Bytes stage `sid` sends on per micro-batch: its last unit's output in a chain; in a DAG, every edge from a
    unit at or before this stage to a unit after it (skip connections ride along through later stages)."""
    last = unit_index[stages[sid][-1]]
    if not profile.edges:
        return float(profile.units[last].output_bytes)
    return float(sum(e.bytes for e in profile.edges if e.src <= last < e.dst))


def _crosses_nodes(rank_a: int, rank_b: int, cluster: ClusterProfile) -> bool:
    return rank_a // cluster.devices_per_node != rank_b // cluster.devices_per_node


def estimate(strategy: Strategy, profile: ModelProfile, cluster: ClusterProfile, *, compact: bool = False,
             per_rank: bool | None = None) -> Estimate:
    """Predict one training step of `strategy` (validated against the profile's units) on `cluster`.

    compact=True is for ranking many candidates: the same step time and fit, but no separate bubble / p2p split
    (one simulation instead of two; bubble_s holds both) and one memory entry per pipeline rank instead of one
    per global rank. Reports and plan files use full estimates. per_rank (default: not compact) chooses the
    listings alone: one memory entry per global rank and every rank's action order, or neither (they grow with
    dp x pp and m x pp x v; a plan's alternatives need the split, not the listings)."""
    per_rank = not compact if per_rank is None else per_rank
    s = strategy
    s.validate(tuple(u.name for u in profile.units))
    p_b, g_b, _ = BYTES_PER_PARAM[(s.precision, s.optimizer)]
    compute_dtype = "fp32" if s.precision == "fp32" else "bf16"
    act_scale = (s.micro_batch_size / profile.micro_batch_size) * DTYPE_BYTES[compute_dtype] / DTYPE_BYTES[profile.dtype]
    world = s.world_size

    unit_index = {u.name: i for i, u in enumerate(profile.units)}
    input_bytes = math.prod(profile.input.shape) * (8 if profile.input.kind == "tokens" else DTYPE_BYTES[profile.dtype])
    overheads = cluster.compute or _NO_OVERHEADS
    stage_costs, stage_info = [], []
    unit_fb: list[tuple[float, float]] = []   # per unit (forward, backward incl. recompute) of one micro-batch
    for sid, units in enumerate(s.stages):
        fwd = bwd = 0.0
        for name in units:
            f, b = unit_times(profile.unit(name), profile, cluster, micro_batch_size=s.micro_batch_size,
                              precision=s.precision, ranks_running=world)
            fwd, bwd = fwd + f, bwd + b
            unit_fb.append((f, b + (f if s.stage_recompute(sid) else 0.0)))
        members = [profile.unit(n) for n in units]
        first = unit_index[units[0]]
        stage_input = input_bytes * s.micro_batch_size / profile.micro_batch_size if first == 0 else \
            profile.units[first - 1].output_bytes * act_scale
        if s.stage_recompute(sid):
            # Full recompute keeps each unit's input per micro-batch and one unit's working set at a time
            # (Korthikanti et al. 2022, section 4: 2sbh per layer in 16-bit instead of sbh(34 + 5as/h)).
            inputs = stage_input + sum(profile.units[unit_index[n] - 1].output_bytes * act_scale for n in units[1:])
            act = inputs
            bwd += fwd
        else:
            act = sum(u.saved_bytes for u in members) * act_scale
        boundary = _boundary_bytes(profile, s.stages, sid, unit_index) * act_scale
        params, largest = _stage_params(profile, units)
        rank = stage_to_rank(sid, s.pp) * s.dp
        nxt = stage_to_rank(sid + 1, s.pp) * s.dp
        prv = stage_to_rank(sid - 1, s.pp) * s.dp
        send_f = p2p_time(cluster, boundary, crosses_nodes=_crosses_nodes(rank, nxt, cluster)) if sid < s.n_stages - 1 else 0.0
        send_b = p2p_time(cluster, stage_input, crosses_nodes=_crosses_nodes(rank, prv, cluster)) if sid > 0 else 0.0
        if s.n_stages > 1:
            # torch's schedule runtime costs a fixed amount per action (probed); zero-bubble splits B into I and W
            per_action = overheads.pipeline_action_s
            fwd, bwd = fwd + per_action, bwd + per_action * (2 if s.schedule == "zb-interleaved" else 1)
        stage_costs.append(StageCost(fwd_s=fwd, bwd_s=bwd, send_fwd_s=send_f, send_bwd_s=send_b, activation_bytes=act))
        working_set = max(u.saved_bytes for u in members) * act_scale if s.stage_recompute(sid) else 0.0
        stage_info.append((units, params, largest, fwd, bwd, act, boundary, working_set, stage_input))

    schedule = s.schedule if s.pp > 1 or s.v > 1 else "1f1b"   # one stage: plain gradient accumulation
    sim = simulate_schedule(schedule, s.pp, s.microbatches, s.v, tuple(stage_costs))
    free = sim if compact else simulate_schedule(
        schedule, s.pp, s.microbatches, s.v,
        tuple(StageCost(fwd_s=c.fwd_s, bwd_s=c.bwd_s, activation_bytes=c.activation_bytes) for c in stage_costs))

    # Data-parallel collectives per pipeline rank (all its stages), and what is exposed.
    dp_rpn = math.gcd(s.dp, cluster.devices_per_node) if s.dp > cluster.devices_per_node else None

    def coll(op: str, size: float) -> float:
        return collective_time(cluster, op, size, s.dp, ranks_per_node=dp_rpn)

    dp_bytes: dict[str, float] = {}
    rank_end: list[float] = []
    rank_dp: list[float] = []
    for r in range(s.pp):
        exposed = 0.0
        units = [(profile.unit(n).params + _shared_numel(profile, n, stage_info[sid][0]), profile.unit(n).param_tensors)
                 for sid in range(r, s.n_stages, s.pp) for n in stage_info[sid][0]]
        for op, count, size in _dp_collectives(s, units, p_b, g_b):
            exposed += count * coll(op, size)
            if r == 0:
                dp_bytes[op] = dp_bytes.get(op, 0.0) + count * size
        if s.dp > 1 and s.zero >= 2:
            # FSDP2's per-unit work beyond compute and collective latency (probed), every micro-batch: one unit per
            # pipeline unit without a pipeline, one per stage with one
            fsdp_units = len(units) if s.pp == 1 else len(range(r, s.n_stages, s.pp))
            exposed += s.microbatches * fsdp_units * overheads.fsdp_unit_s
        if cluster.device.kind == "gpu" and s.pp == 1 and s.dp > 1:
            exposed = _overlapped_dp_time(s, profile, unit_fb, coll, p_b, g_b)
        rank_dp.append(exposed)
        rank_end.append(sim.finish_s.get(r, 0.0) + exposed)

    opt_params = max(sum(stage_info[sid][1] for sid in range(r, s.n_stages, s.pp)) for r in range(s.pp))
    opt_params_rank = opt_params / (s.dp if s.zero >= 1 else 1)
    opt_tensors = max(sum(max(1, profile.unit(n).param_tensors) for sid in range(r, s.n_stages, s.pp)
                          for n in stage_info[sid][0]) for r in range(s.pp))
    # FSDP2 keeps a shard of every tensor on every rank; ZeroRedundancyOptimizer gives each rank whole tensors
    opt_tensors_rank = opt_tensors / (s.dp if s.zero == 1 else 1)
    optimizer_s = (optimizer_step_time(opt_params_rank, precision=s.precision, optimizer=s.optimizer, cluster=cluster)
                   + opt_tensors_rank * overheads.optimizer_tensor_s)
    total = max(rank_end) + optimizer_s
    critical = max(range(s.pp), key=lambda r: rank_end[r])

    breakdown = StepBreakdown(
        compute_s=sim.busy_s[critical], bubble_s=max(0.0, free.makespan_s - free.busy_s[critical]),
        p2p_s=max(0.0, sim.makespan_s - free.makespan_s), dp_comm_s=rank_dp[critical], optimizer_s=optimizer_s,
        total_s=total)

    memory = _memory(s, profile, cluster, stage_info, sim, p_b, g_b, per_rank=per_rank)
    per_sequence = profile.input.kind in ("tokens", "features")   # "custom": no sequence axis, count samples
    tokens = s.global_batch_size * (profile.seq_len if per_sequence else 1)
    model_flops = sum(u.fwd_flops + u.bwd_flops for u in profile.units) / profile.micro_batch_size * s.global_batch_size
    peak = cluster.device.peak_flops.get(compute_dtype)
    # MFU: model FLOPs (no recompute) / (step time x devices x dense peak) (Chowdhery et al. 2022, PaLM, appendix B)
    mfu = model_flops / (total * world * peak) if peak and total > 0 and cluster.device.kind == "gpu" else None
    p2p_bytes = sum(2 * info[6] for info in stage_info[:-1]) * s.microbatches
    crossing = sum(_crosses_nodes(stage_to_rank(i, s.pp) * s.dp, stage_to_rank(i + 1, s.pp) * s.dp, cluster)
                   for i in range(s.n_stages - 1))
    p2p_link = f"{crossing} of {s.n_stages - 1} stage boundaries inter-node" if s.n_stages > 1 else "none"
    dp_link = "inter-node" if s.dp > cluster.devices_per_node else "intra-node"
    return Estimate(
        step_time_s=total, breakdown=breakdown, bubble_ratio=free.bubble_ratio, bubble_share=free.bubble_share,
        tokens_per_step=tokens, tokens_per_s=tokens / total if total > 0 else 0.0,
        throughput_unit="tokens" if per_sequence else "samples", mfu=mfu,
        stages=tuple(StageEstimate(stage=i, units=info[0], params=info[1], fwd_s=info[3], bwd_s=info[4],
                                   activation_bytes=info[5], boundary_bytes=info[6],
                                   peak_in_flight=sim.peak_in_flight.get(i, 0), send_fwd_s=stage_costs[i].send_fwd_s,
                                   send_bwd_s=stage_costs[i].send_bwd_s) for i, info in enumerate(stage_info)),
        memory_per_rank=memory, capacity_bytes=cluster.device.memory_bytes,
        fits=max(m.total_bytes for m in memory) <= cluster.device.memory_bytes,
        comm=CommVolume(p2p_bytes_per_step=p2p_bytes, dp_bytes_per_rank=sum(dp_bytes.values()),
                        dp_collectives=dp_bytes, p2p_link=p2p_link, dp_link=dp_link),
        compute_source="measured" if uses_measured_times(profile, cluster) else "flops",
        pipeline_order=format_order(cached_order(schedule, s.pp, s.microbatches, s.v)) if per_rank else {})


DDP_BUCKET_BYTES = 25 * 2**20   # DistributedDataParallel's default bucket_cap_mb


def _dp_collectives(s: Strategy, units: list[tuple[int, int]], p_b: int, g_b: int) -> list[tuple[str, int, float]]:
    """(op, times per step, full buffer bytes) of every collective one pipeline rank's dp group issues per step,
    as the executor issues them (module doc): each message pays the latency alpha, so the count matters as much
    as the bytes. `units` holds (parameters, parameter tensors) of the units on this rank."""
    if s.dp == 1:
        return []
    m, pipelined = s.microbatches, s.pp > 1
    total = sum(n for n, _ in units)
    tensors = [(n / max(1, t), max(1, t)) for n, t in units]   # (elements per tensor, tensors) per unit
    per_tensor = [(size, count) for size, count in tensors]
    out: list[tuple[str, int, float]] = []
    if s.zero <= 1:
        if pipelined:   # all_reduce_grads: one all-reduce per parameter tensor
            out += [("all_reduce", count, size * g_b) for size, count in per_tensor]
        else:           # DDP: one all-reduce per gradient bucket
            buckets = max(1, math.ceil(total * g_b / DDP_BUCKET_BYTES))
            out.append(("all_reduce", buckets, total * g_b / buckets))
        if s.zero == 1:  # ZeroRedundancyOptimizer broadcasts every updated parameter tensor from its owner
            out += [("all_gather", count, size * p_b) for size, count in per_tensor]
        return out
    gathers = 2 * m if s.zero == 3 else (1 if pipelined else m)
    reduces = 1 if pipelined else m
    if pipelined:   # one FSDP unit per stage: one gather and one reduce-scatter of the whole stage each time
        return [("all_gather", gathers, total * p_b), ("reduce_scatter", reduces, total * g_b)]
    # without a pipeline every unit is its own FSDP unit
    return ([("all_gather", gathers, n * p_b) for n, _ in units]
            + [("reduce_scatter", reduces, n * g_b) for n, _ in units])


def _overlapped_dp_time(s: Strategy, profile: ModelProfile, unit_fb: list[tuple[float, float]], coll,
                        p_b: int, g_b: int) -> float:
    """Exposed data-parallel time without a pipeline on GPUs, where NCCL runs beside compute.

    FSDP2 wraps each unit and prefetches one unit ahead (Zhao et al. 2023, "PyTorch FSDP", section 3.3): the
    gather of unit u hides behind the forward of unit u-1 (the first unit's cannot hide), and in backward the
    gather and reduce-scatter of unit u behind its backward. DDP all-reduces gradient buckets while the last
    micro-batch's backward runs; ZeroRedundancyOptimizer broadcasts updated shards after the step (exposed).
    """
    params = [u.params for u in profile.units]
    m = s.microbatches
    if s.zero <= 1:
        ar = coll("all_reduce", sum(params) * g_b)
        exposed = max(0.0, ar - sum(b for _, b in unit_fb))
        return exposed + (coll("all_gather", sum(params) * p_b) if s.zero == 1 else 0.0)
    gather = [coll("all_gather", n * p_b) for n in params]
    reduce = [coll("reduce_scatter", n * g_b) for n in params]
    fwd = gather[0] + sum(max(0.0, gather[u] - unit_fb[u - 1][0]) for u in range(1, len(params)))
    if s.zero == 2:   # gathered once per micro-batch, kept through backward; gradients reduce-scattered per unit
        bwd = sum(max(0.0, reduce[u] - unit_fb[u][1]) for u in range(len(params)))
    else:             # ZeRO-3 gathers again for backward
        bwd = sum(max(0.0, gather[u] + reduce[u] - unit_fb[u][1]) for u in range(len(params)))
    return m * (fwd + bwd)


def _memory(s: Strategy, profile: ModelProfile, cluster: ClusterProfile, stage_info, sim, p_b: int,
            g_b: int, *, per_rank: bool = True) -> tuple[MemoryBreakdown, ...]:
    per_pp_rank = []
    for r in range(s.pp):
        sids = tuple(range(r, s.n_stages, s.pp))
        params = sum(stage_info[i][1] for i in sids)
        largest = max(stage_info[i][2] for i in sids)
        p, g, o = executor_state_bytes(params, s.dp, s.zero, s.precision, s.optimizer)
        buffers = comm_buffer_bytes(stage_params=params, largest_unit_params=largest, zero=s.zero, pp=s.pp, dp=s.dp,
                                    param_bytes=p_b, grad_bytes=g_b)
        activations = sim.peak_activation_bytes.get(r, 0.0) + max(stage_info[i][7] for i in sids)
        shares = None
        numels = [n for i in sids for u in stage_info[i][0] for n in _unit_numels(profile, u, stage_info[i][0])]
        if s.zero == 1 and s.dp > 1 and numels:
            k_b = BYTES_PER_PARAM[(s.precision, s.optimizer)][2]
            shares = [k_b * n for n in zero1_partition(numels, s.dp)]
        per_pp_rank.append((sids, p, g, o, activations, buffers, shares))
    overhead = OVERHEAD_BYTES[cluster.device.kind]
    out = []
    for rank in (range(s.world_size) if per_rank else range(0, s.world_size, s.dp)):
        sids, p, g, o, a, b, shares = per_pp_rank[rank // s.dp]
        if shares is not None:   # ZeroRedundancyOptimizer's uneven split (the compact form keeps the largest);
            d = rank % s.dp      # dp ranks past the tensor count own no tensor (zero1_partition)
            o = (shares[d] if d < len(shares) else 0) if per_rank else max(shares)
        out.append(MemoryBreakdown(rank=rank, stages=sids, parameters=int(p), gradients=int(g), optimizer_states=int(o),
                                   activations=int(a), buffers=int(b), overhead=overhead))
    return tuple(out)


def _unit_numels(profile: ModelProfile, unit: str, stage_units) -> list[int]:
    """Sizes of the parameter tensors a unit holds in its stage (tied copies included); [] for old profiles."""
    u = profile.unit(unit)
    extra = [sp.numel for alias in u.shared_params for sp in profile.shared
             if alias in sp.aliases and sp.units[0] not in stage_units]
    return list(u.param_numels) + extra if u.param_numels else []
