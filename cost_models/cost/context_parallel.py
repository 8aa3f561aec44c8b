"""Context parallelism's costs (pure functions): each sequence split over cp ranks, attention meeting over their
keys and values (executor.context_parallel runs it).

Layout (torchtitan's, torchtitan/distributed/parallel_dims.py): the cp ranks of a CP group are consecutive data
ranks, each tp apart, on the mesh (pp, dp x cp, tp); parameters are sharded and gradients averaged over dp x cp.
Everything but attention is what data parallelism over dp x cp ranks costs with micro-batches of seq_len / cp
tokens each: so the estimate prices Strategy.data_view on a view of the profile whose micro-batch stands for cp
times the sequences at seq_len / cp tokens (cp_view: every unit's work, times and saved bytes scale with its
tokens). That holds for attention too: with the load-balanced split (rank i holds chunks i and 2cp-1-i of 2 x cp;
Grattafiori et al. 2024, "The Llama 3 Herd of Models", section 3.3.2) every rank does 1/cp of the causal attention
of its sequences, and the profile's attention at seq_len is a whole sequence's.

What CP adds, per attention unit and micro-batch (cp_unit): an all-gather of the group's keys and of its values in
forward, a reduce-scatter of their gradients in backward (Llama 3, section 3.3.2: the all-gather based CP), full
buffer K (V) = micro-batch x seq_len x key width x bytes of this rank's heads (/ tp), on the link the group spans,
exposed (the attention waits for them); the gathered keys and values kept for backward beyond the rank's own,
(cp-1)/cp of the full buffers. Byte convention as cost.comm's (full buffers). Full recompute gathers again in the
recomputed forward; selective recompute keeps the gathered keys and values (its checkpoint wraps the kernel after
the gather) and gathers once.
"""
from __future__ import annotations

import dataclasses

from cost_models.cost.comm import collective_time, group_ranks_per_node
from cost_models.records.cluster import ClusterProfile
from cost_models.records.profile import ModelProfile, UnitProfile

# views made per (profile, cp), and each view's profile: the estimate caches unit costs by the profile's id, so a
# view is kept (with the profile it came from) while it may be asked for again, never remade under an id another
# view had; the search costs a view's points, which the estimate prices from the profile (cp_origin)
_VIEWS: dict[tuple[int, int], tuple[ModelProfile, ModelProfile]] = {}
_ORIGINS: dict[int, tuple[ModelProfile, ModelProfile]] = {}
_MAX_VIEWS = 64


@dataclasses.dataclass(frozen=True, kw_only=True)
class CPUnitCost:
    fwd_s: float = 0.0         # its all-gathers in one micro-batch's forward
    bwd_s: float = 0.0         # its reduce-scatters in the backward
    kept: float = 0.0          # gathered keys and values kept beyond the rank's own, at the profile's scale
    bytes: float = 0.0         # full-buffer bytes of its collectives (forward, backward; the recomputed forward)


def cp_refusal(profile: ModelProfile, cp: int) -> str | None:
    """Why `profile` cannot be planned with context parallelism over cp ranks (a power of two:
    strategy.check_cp_degree), or None."""
    if cp == 1:
        return None
    why = split_refusal(profile.seq_len, cp)
    if why:
        return why
    if not any(u.tp is not None and u.tp.core_kv_bytes for u in profile.units):
        return (f"{profile.name}'s profile records no attention kernel (scaled_dot_product_attention) whose keys and "
                f"values context parallelism could gather; profile it again, or plan it with cp = 1")
    return None


def split_refusal(seq_len: int, cp: int) -> str | None:
    """Why a sequence of `seq_len` tokens does not split into 2 x cp equal chunks, or None."""
    if cp > 1 and seq_len % (2 * cp):
        return (f"context parallelism over {cp} ranks cuts each sequence into {2 * cp} equal chunks; --seq-len "
                f"{seq_len} is not a multiple of {2 * cp}")
    return None


def cp_view(profile: ModelProfile, cp: int) -> ModelProfile:
    """The profile as data parallelism over dp x cp ranks sees it (module doc): a micro-batch of cp times the
    sequences at seq_len / cp tokens, so that a plan's micro-batch scales every unit by 1/cp. Its one-sample
    timings are dropped: one sample of the view is a slice of a sequence, so times scale in proportion."""
    key = (id(profile), cp)
    hit = _VIEWS.get(key)
    if hit is not None and hit[0] is profile:
        return hit[1]
    units = tuple(dataclasses.replace(u, fwd_time_one=None, bwd_time_one=None) for u in profile.units)
    view = dataclasses.replace(profile, micro_batch_size=profile.micro_batch_size * cp,
                               seq_len=profile.seq_len // cp, units=units)
    if len(_VIEWS) >= _MAX_VIEWS:
        _, old = _VIEWS.pop(next(iter(_VIEWS)))
        _ORIGINS.pop(id(old), None)
    _VIEWS[key] = (profile, view)
    _ORIGINS[id(view)] = (view, profile)
    return view


def cp_origin(profile: ModelProfile) -> ModelProfile:
    """The profile a cp_view was made from, or `profile` itself where it is not a view."""
    hit = _ORIGINS.get(id(profile))
    return hit[1] if hit is not None and hit[0] is profile else profile


def cp_unit(u: UnitProfile, cluster: ClusterProfile, *, cp: int, tp: int, act_scale: float,
            recompute: bool) -> CPUnitCost:
    """CP's collectives and kept keys and values for one micro-batch through unit `u` (module doc). `act_scale`
    turns the view profile's bytes into this micro-batch's in the compute dtype (estimate.activation_scale)."""
    kv = u.tp.core_kv_bytes if u.tp is not None else 0
    if cp == 1 or not kv:
        return CPUnitCost()
    full = kv * cp * act_scale / tp    # keys + values of whole sequences, this rank's heads
    rpn = group_ranks_per_node(cluster, n=cp, stride=tp)   # cp consecutive data ranks
    fwd = 2 * collective_time(cluster, "all_gather", full / 2, cp, ranks_per_node=rpn)
    bwd = 2 * collective_time(cluster, "reduce_scatter", full / 2, cp, ranks_per_node=rpn)
    return CPUnitCost(fwd_s=fwd, bwd_s=bwd, kept=(cp - 1) * kv / tp, bytes=full * (3 if recompute else 2))
