"""Expert parallelism's costs (pure functions): the routed experts' load imbalance, the token all-to-alls, and
where an expert-parallel group sits on the mesh.

Layout (torchtitan's, torchtitan/distributed/parallel_dims.py: expert-parallel ranks are borrowed from the data-
parallel ones, so the world size is unchanged): on the mesh (pp, dp, tp) the dp ranks split into dp / ep groups of
ep consecutive dp ranks; each EP group holds every routed expert once, E / ep on each rank, and a rank's tokens
are dispatched to the ranks holding their top-k experts and combined back. Dense parameters (attention, norms,
routers, shared experts) are data-parallel over dp as before; the routed experts' over the dp / ep ranks holding
the same experts (their ZeRO group). Tensor-parallel ranks run the MoE blocks whole (their attention is split).

Per MoE block and micro-batch each rank dispatches its tokens x top_k hidden states and receives as many back
(two all-to-alls in forward, two in backward: dispatch and combine, and their gradients; Lepikhin et al. 2021,
"GShard", section 2.2; Rajbhandari et al. 2022, "DeepSpeed-MoE", section 5.2). Byte convention as comm's: the full
buffer is what one rank hands its all_to_all_single (tokens x top_k x hidden x bytes), of which (ep-1)/ep leaves
the rank, spread evenly over the group (the busbw factor nccl-tests doc/PERFORMANCE.md gives all-to-all).

Load: with expert parallelism the step waits for the busiest rank, whose routed work is the mean's times the
imbalance: from the profile's measured load per expert where it has one (real mode: max over the EP ranks of
their experts' load, over the mean), else `DEFAULT_IMBALANCE`, unless the profile's moe_imbalance sets it.
Without expert parallelism each rank runs every expert for its own tokens: no imbalance. Memory does not wait
for an average: where the load was measured window by window (--data), a micro-batch's routed activations are
priced at the busiest rank's load in the worst micro-batch the windows make when dealt as the run deals them
(peak_imbalance), and what the experts and the dispatch keep at it (ep_saved_bytes).

Shapes (GPU pricing by kind of work, cost.kernels): without EP each of the E experts multiplies r = tokens x top_k /
E rows (a meta profile's even routing: cost_models.models.moe.expert_order, run as one batch of E products per
matrix, as the grouped GEMMs of Megatron-Core's and torchtitan's MoE layers run them); with EP a rank runs E / ep
experts, each on the rows every rank of its group sends it, r x ep at the mean and r x ep x imbalance on the
busiest rank (ep_work).
"""
from __future__ import annotations

import dataclasses

from cost_models.records.cluster import ClusterProfile
from cost_models.records.profile import ModelProfile, MoEUnit
from cost_models.records.strategy import Strategy
from cost_models.records.work import WorkCounts

_PEAKS: dict[tuple, tuple[MoEUnit, float]] = {}   # peak_imbalance's answers; the unit is held, so its id stays its own

# The headroom expert capacity is commonly provisioned at over an even load: Switch Transformer trains with a
# capacity factor of 1.0-1.25 (Fedus et al. 2022, "Switch Transformers", section 2.2 and table 1), i.e. the
# busiest expert taking up to 1.25x the mean. Stated, not measured: `--moe-imbalance` sets it, and a real-mode
# profile measures it on its tokens.
DEFAULT_IMBALANCE = 1.25


def imbalance(profile: ModelProfile, u: MoEUnit, ep: int) -> float:
    """The busiest EP rank's routed tokens over the mean for unit `u` at `ep` (module doc); 1 without EP."""
    if ep <= 1:
        return 1.0
    if profile.moe_imbalance > 0:
        return profile.moe_imbalance
    if not u.expert_load or sum(u.expert_load) == 0:
        return DEFAULT_IMBALANCE
    return _busiest_over_mean(u.expert_load, ep)


def _busiest_over_mean(load: tuple[int, ...] | list[int], ep: int) -> float:
    """The most token-expert pairs any EP rank's experts get over the mean (1 where there are none): rank i holds
    experts i*per .. (i+1)*per - 1, in order, per = E / ep."""
    per = len(load) // ep
    ranks = [sum(load[i * per:(i + 1) * per]) for i in range(ep)]
    return max(ranks) / (sum(ranks) / ep) if sum(ranks) else 1.0


def peak_imbalance(profile: ModelProfile, u: MoEUnit, *, ep: int, dp: int, micro_batch_size: int,
                   microbatches: int) -> float:
    """The busiest EP rank's routed rows over the mean in the worst micro-batch, which sets the activations' peak
    (an average load does not: OOM waits for no mean). From the unit's load per window (window_load, measured
    with --data) dealt as the run deals them (deal_windows); else as `imbalance`. Memoised: the search asks it of
    every strategy, over the same units."""
    if ep <= 1 or profile.moe_imbalance > 0 or not u.window_load:
        return imbalance(profile, u, ep)
    key = (id(u), ep, dp, micro_batch_size, microbatches)
    hit = _PEAKS.get(key)
    if hit is None or hit[0] is not u:
        if len(_PEAKS) >= 4096:
            _PEAKS.clear()
        hit = _PEAKS[key] = (u, _worst_group(u, ep=ep, dp=dp, micro_batch_size=micro_batch_size,
                                             microbatches=microbatches))
    return hit[1]


def _worst_group(u: MoEUnit, *, ep: int, dp: int, micro_batch_size: int, microbatches: int) -> float:
    groups = deal_windows(len(u.window_load), ep=ep, dp=dp, micro_batch_size=micro_batch_size,
                          microbatches=microbatches)
    return max(_busiest_over_mean([sum(counts) for counts in zip(*(u.window_load[w] for w in group))], ep)
               for group in groups)


def deal_windows(n: int, *, ep: int, dp: int, micro_batch_size: int, microbatches: int) -> list[list[int]]:
    """The windows (indices into n routed in file order) one EP group routes together in one micro-batch, for every
    such micro-batch in the n windows, as the run deals them: a step's global batch of dp x microbatches x b
    windows is split into dp replicas in order (executor.runtime.rank_batch), each into its micro-batches in
    order, and an EP group is ep consecutive replicas (module doc). With fewer windows than a step's, groups of
    ep x b consecutive windows; with fewer than that, all n as one."""
    b, per_replica = micro_batch_size, micro_batch_size * microbatches
    step = dp * per_replica
    if n >= step:
        return [[t * step + d * per_replica + j * b + i for d in range(e * ep, (e + 1) * ep) for i in range(b)]
                for t in range(n // step) for e in range(dp // ep) for j in range(microbatches)]
    size = ep * b
    return [list(range(g * size, (g + 1) * size)) for g in range(n // size)] or [list(range(n))]


def busiest_load(profile: ModelProfile, ep: int) -> float:
    """The largest imbalance over the MoE units at `ep` (1 without EP or MoE units): Estimate.ep_load."""
    return max((imbalance(profile, u.moe, ep) for u in profile.units if u.moe is not None), default=1.0)


def busiest_peak_load(profile: ModelProfile, s: Strategy) -> float:
    """The largest peak_imbalance over the MoE units under strategy `s` (1 without EP or MoE units):
    Estimate.ep_peak_load."""
    return max((peak_imbalance(profile, u.moe, ep=s.ep, dp=s.dp, micro_batch_size=s.micro_batch_size,
                               microbatches=s.microbatches) for u in profile.units if u.moe is not None), default=1.0)


def imbalance_source(profile: ModelProfile, ep: int, *, peak: float | None = None) -> str:
    """The load the estimate prices EP at (busiest_load) and where it comes from, for explanations; `peak`: the
    load its activations are priced at (Estimate.ep_peak_load), said where it differs."""
    load = busiest_load(profile, ep)
    if profile.moe_imbalance > 0:
        why = "set by --moe-imbalance"
    elif not all(u.moe.expert_load for u in profile.units if u.moe is not None):
        why = "the stated default where no routing was measured (planner profile --init-from --data measures it)"
    else:
        why = "measured on " + (profile.routing or "the profile's synthetic tokens through untrained weights")
    worst = f", x{peak:.2f} in its worst micro-batch (its activations are priced there)" if peak and \
        round(peak, 2) != round(load, 2) else ""
    return f"the busiest EP rank routes x{load:.2f} the mean{worst}, {why}"


def ep_work(work: WorkCounts, u: MoEUnit, *, ep: int, load: float) -> WorkCounts | None:
    """One pass's work on the busiest EP rank (module doc, shapes): each routed-expert product (a shape whose rows
    or depth are the profile's r = tokens x top_k / E and that runs a multiple of E times, as E products or one
    batch of E) runs E / ep times on r x ep x load rows. Other work as profiled (its memory-bound bytes and
    kernels: an upper bound). None where those products are not found making up the routed FLOPs (a real
    routing's uneven shapes, or tokens x top_k not a multiple of E): the caller prices the routed share by FLOPs
    instead."""
    r, even = divmod(u.tokens * u.top_k, u.experts)
    if ep == 1:
        return work
    if r == 0 or even:
        return None
    rows = max(1, round(r * ep * load))
    gemms, found = [], 0
    for g in work.gemms:
        batched = g.batch % u.experts == 0
        routed = (batched or g.count % u.experts == 0) and r in (g.m, g.k)
        found += g.flops if routed else 0
        if not routed:
            gemms.append(g)
            continue
        fewer = {"batch": g.batch // ep} if batched else {"count": g.count // ep}
        gemms.append(dataclasses.replace(g, **({"m": rows} if g.m == r else {"k": rows}), **fewer))
    # forward: the routed forward's FLOPs; backward: twice them; a dense product of the same shape would add more
    if not any(abs(found - want) <= 0.01 * want for want in (u.routed_fwd_flops, u.routed_bwd_flops)):
        return None
    return dataclasses.replace(work, gemms=tuple(gemms))


def ep_saved_bytes(u: MoEUnit, *, load: float, elem_bytes: int, dtype_ratio: float) -> float:
    """What one micro-batch through the unit's MoE blocks keeps for backward under expert parallelism on a rank
    whose experts receive `load` x the mean rows, at the profile's scale (as estimate's kept bytes: elem_bytes is
    the profile's element size, dtype_ratio the compute dtype's over it), in place of routed_saved_bytes:
      * the experts' own, called with weights of one that need no gradient (MoEUnit.routed_unweighted_bytes;
        a profile without it: routed_saved_bytes), per row they receive;
      * what executor.expert_parallel.Dispatch keeps around them, counted from its code: per row the rank sends,
        the combined row and its weight (the factors of the weighting, each the other's gradient), in the
        activations' dtype, and three int64 indices (the gathers of rows to send and of their weights, and the
        gather back to token order); per row it receives, two int64 indices (the regrouping by local expert and
        back)."""
    rows = u.blocks * u.tokens * u.top_k   # routed rows a rank sends at the mean: tokens x top_k per block
    experts = u.routed_unweighted_bytes if u.routed_unweighted_bytes >= 0 else u.routed_saved_bytes
    return experts * load + rows * (u.hidden + 1) * elem_bytes + rows * 8 * (3 + 2 * load) / dtype_ratio


def dispatch_bytes(u: MoEUnit, *, scale: float, elem_bytes: int) -> float:
    """One all-to-all's full buffer per rank for the unit's blocks at this micro-batch (scale: micro-batch over
    the profile's): tokens x top_k x hidden x bytes, summed over its blocks."""
    return u.blocks * u.tokens * scale * u.top_k * u.hidden * elem_bytes


def all_to_all_time(cluster: ClusterProfile, size_bytes: float, n: int, *, ranks_per_node: int | None) -> float:
    """Seconds of one all-to-all over n ranks, S = the full buffer per rank (module doc). The probe's fit for this
    group where it measured one; else from the links: (g-1)/n x S inside the node on its links and (n-g)/n x S
    across nodes on the rank's share of the network, at once, after one latency (NCCL runs the n-1 peer transfers
    of ncclAllToAll as grouped sends and receives, concurrently)."""
    if n <= 1 or size_bytes <= 0:
        return 0.0
    g = min(n, ranks_per_node or cluster.devices_per_node)
    # the probe's groups: inside a node, or one rank per node across nodes
    fit = cluster.fit("all_to_all", n, "intra") if g == n else cluster.fit("all_to_all", n, "inter") if g == 1 else None
    if fit is not None:
        return fit.predict(size_bytes)
    intra = (g - 1) / n * size_bytes / cluster.intra_node.bandwidth_Bps
    if g == n or cluster.inter_node is None:
        return cluster.intra_node.alpha_s + (n - 1) / n * size_bytes / cluster.intra_node.bandwidth_Bps
    inter = (n - g) / n * size_bytes / cluster.inter_node.bandwidth_Bps
    return cluster.inter_node.alpha_s + max(intra, inter)


def check_ep(profile: ModelProfile, ep: int) -> str | None:
    """Why `ep` cannot split this model's experts, or None."""
    if ep == 1:
        return None
    if not profile.moe_units:
        return (f"--ep {ep} splits routed experts, and {profile.name} has no mixture-of-experts blocks; use --ep 1 "
                f"(or re-profile: profiles written before MoE blocks were recorded have none)")
    if profile.experts % ep:
        return f"--ep {ep} does not divide the {profile.experts} routed experts per block; use a divisor of it"
    return None
