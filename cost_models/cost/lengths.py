"""A profile taken at one sequence length, seen at another (pure functions): what a plan at 131,072 tokens needs
from a profile measured at 4,096.

Per layer and micro-batch of b sequences of s tokens, a transformer's work is a part linear in s (the projections,
MLP, norms, residual adds, embedding and head: 24 b s h^2 FLOPs and its memory-bound traffic) and attention's
quadratic core (4 b s^2 h FLOPs in forward): Narayanan et al. 2021, "Efficient Large-Scale Language Model Training
on GPU Clusters Using Megatron-LM", section 5.1 (their FLOP formula, whose two terms these are). The profile keeps
the attention core apart (profile.TPUnit.core_flops: SDPA's forward FLOPs; torch's FLOP formula counts its backward
as 2.5 times the forward: torch.utils.flop_counter.sdpa_backward_flop_count; WorkCounts.attention_flops: what the
fused kernels execute). So at r = new / old length:
  * FLOPs, attention's: x r^2; the rest: x r. Measured times split in the same proportion (a pass's time over its
    FLOPs at one rate per part, the assumption behind the FLOP formula's use for MFU in the paper above), less a
    call's fixed cost, which stays (the intercept of compute.affine_parts's line; on GPUs the in-model gap per call).
  * Bytes kept for backward, crossing a stage boundary, moved by collectives, read and written by memory-bound
    kernels: x r. The fused attention kernels keep O(s) per head (Dao et al. 2022, "FlashAttention", section 3.1:
    the output and its log-sum-exp, never the s x s scores), as do the causal masks SDPA takes as a flag; a model
    that materialises an s x s mask or scores keeps more than this says (profile at the target length).
  * Matrix products: the dimension that is the micro-batch's tokens scales (a forward or input-gradient
    product's rows, a weight gradient's depth); products per sequence (batched over sequences), the dimension
    equal to the sequence length.
Refused (one line, profile at the target length instead): a profile that does not keep attention's FLOPs apart
(TPUnit, recorded for models with a tensor-parallel plan), mixture-of-experts profiles (routed products' rows
follow the router, not the tokens), inputs without a sequence axis, and attention computed outside
scaled_dot_product_attention (batched products over two sequence-long dimensions), whose quadratic part the
profile cannot tell apart.
"""
from __future__ import annotations

import dataclasses

from cost_models.records.errors import ConfigError
from cost_models.records.limits import check_seq_len
from cost_models.cost.compute import affine_parts
from cost_models.records.profile import ModelProfile, Timing, TPUnit, UnitEdge, UnitProfile, counts_positions
from cost_models.records.work import Gemm, WorkCounts

# torch's FLOP formula for SDPA's backward: five products of the forward's two's size (the scores recomputed, then
# the gradients of scores, values, queries and keys): torch.utils.flop_counter.sdpa_backward_flop_count
BACKWARD_CORE = 2.5
# TPUnit's counts that are bytes or FLOPs of the linear part (the calls, counts of modules, do not change)
_TP_LINEAR = ("vocab_flops", "core_kv_bytes", "saved_split", "saved_seq", "saved_col_input",
              "saved_core", "saved_logits", "row_bytes", "region_bytes", "repl_region_bytes", "entry_bytes",
              "embed_bytes", "whole_embed_bytes", "input_bytes", "head_in_bytes", "logit_bytes")
_UNIT_LINEAR = ("output_bytes", "saved_bytes", "split_kept_bytes", "split_after_bytes", "saved_fixed_bytes",
                "saved_other_dtype_bytes", "saved_other_fixed_bytes", "transient_bytes")


def length_refusal(profile: ModelProfile) -> str | None:
    """Why `profile` cannot be seen at another sequence length (module doc), or None."""
    fix = f"profile {profile.name} at the sequence length to plan"
    if not counts_positions(profile.input.kind) or len(profile.input.shape) < 2:
        return f"{profile.name}'s input has no sequence axis; {fix}"
    if any(u.moe is not None for u in profile.units):
        return f"{profile.name} routes tokens to experts, which this scaling does not model; {fix}"
    for u in profile.units:
        if u.tp is None and (u.fwd_work.attention_flops if u.fwd_work else profile.attention_kernels):
            return (f"{profile.name}'s profile does not record unit {u.name}'s attention FLOPs apart from the rest "
                    f"(a model without a tensor-parallel plan); {fix}")
        for work in (u.fwd_work, u.bwd_work):
            if work is not None and any(g.batch > 1 and _sequence_dims(g, profile.seq_len) >= 2
                                        for g in work.gemms):
                return (f"unit {u.name} computes attention outside scaled_dot_product_attention (products over "
                        f"two {profile.seq_len}-long dimensions); {fix}")
    return None


def at_seq_len(profile: ModelProfile, seq_len: int) -> ModelProfile:
    """`profile` as if profiled at `seq_len` tokens per sequence, at the same micro-batch (module doc)."""
    check_seq_len(seq_len)
    if seq_len == profile.seq_len:
        return profile
    why = length_refusal(profile)
    if why:
        raise ConfigError(why)
    r = seq_len / profile.seq_len
    units = tuple(_unit(u, r, batch=profile.micro_batch_size, seq_len=profile.seq_len) for u in profile.units)
    outside = profile.model_fwd_flops - sum(u.fwd_flops for u in profile.units)
    shape = list(profile.input.shape)
    shape[1] = seq_len
    return dataclasses.replace(
        profile, seq_len=seq_len, units=units, profiled_seq_len=profile.profiled_seq_len or profile.seq_len,
        input=dataclasses.replace(profile.input, shape=tuple(shape)), in_model_factor=_gap_kept(profile, units),
        model_fwd_flops=sum(u.fwd_flops for u in units) + round(outside * r),
        edges=tuple(UnitEdge(src=e.src, dst=e.dst, bytes=round(e.bytes * r)) for e in profile.edges))


def _gap_kept(profile: ModelProfile, units: tuple[UnitProfile, ...]) -> float:
    """The in-model factor at the new length. On a GPU a factor below 1 is a fixed cost per call
    (compute._gap_per_call: (1 - f) x the unit's time at the profile), which does not grow with the sequence: f
    such that (1 - f) x the new times gives the old seconds, over all units. Elsewhere it is a share: unchanged."""
    f = profile.in_model_factor
    if profile.device != "gpu" or f >= 1:
        return f
    old = sum(u.fwd_time.median_s + u.bwd_time.median_s for u in profile.units if u.fwd_time and u.bwd_time)
    new = sum(u.fwd_time.median_s + u.bwd_time.median_s for u in units if u.fwd_time and u.bwd_time)
    return 1 - (1 - f) * old / new if new > 0 else f


def length_line(profile: ModelProfile) -> str | None:
    """What at_seq_len did to `profile`, in one line for the plan's provenance, or None where it is as measured."""
    if not profile.profiled_seq_len or profile.profiled_seq_len == profile.seq_len:
        return None
    r = profile.seq_len / profile.profiled_seq_len
    return (f"profiled at {profile.profiled_seq_len:,} tokens per sequence and seen at {profile.seq_len:,}: the "
            f"attention core's FLOPs and time x{r * r:,.4g}, the rest's and every byte x{r:,.4g} "
            f"(cost_models.cost.lengths); profile at {profile.seq_len:,} to measure it")


def _unit(u: UnitProfile, r: float, *, batch: int, seq_len: int) -> UnitProfile:
    tokens = batch * seq_len
    core = u.tp.core_flops if u.tp is not None else 0
    fwd = _two_parts(u.fwd_flops, core, r)
    bwd = _two_parts(u.bwd_flops, BACKWARD_CORE * core, r)
    # a unit without FLOPs (an embedding's gather) is memory-bound: linear in the tokens
    f_share, b_share = (fwd / u.fwd_flops if u.fwd_flops else r), (bwd / u.bwd_flops if u.bwd_flops else r)
    scaled = {k: round(getattr(u, k) * r) for k in _UNIT_LINEAR}
    suffix = None if u.split_suffix_bytes is None else round(u.split_suffix_bytes * r)
    fwd_t, fwd_one = _times(u.fwd_time, u.fwd_time_one, f_share, batch)
    bwd_t, bwd_one = _times(u.bwd_time, u.bwd_time_one, b_share, batch)
    return dataclasses.replace(
        u, fwd_flops=round(fwd), bwd_flops=round(bwd), split_suffix_bytes=suffix, **scaled,
        fwd_time=fwd_t, bwd_time=bwd_t, fwd_time_one=fwd_one, bwd_time_one=bwd_one,
        tp=_tp(u.tp, r), fwd_work=_work(u.fwd_work, r, tokens=tokens, seq_len=seq_len, backward=False),
        bwd_work=_work(u.bwd_work, r, tokens=tokens, seq_len=seq_len, backward=True))


def _two_parts(total: int, quadratic: float, r: float) -> float:
    quadratic = min(quadratic, total)
    return (total - quadratic) * r + quadratic * r * r


def _times(at: Timing | None, one: Timing | None, share: float, batch: int) -> tuple[Timing | None, Timing | None]:
    """A unit pass's timings at the profile's micro-batch and on one sample, at the new length: the work grows by
    `share`, the fixed cost of a call (the intercept of the line through the two timings: compute.affine_parts) does
    not. Where only one timing was taken, all of it grows."""
    if at is None:
        return None, None
    fixed = max(0.0, affine_parts(at, one, batch, 1)[0])

    def grown(t: Timing | None) -> Timing | None:
        if t is None:
            return None
        return dataclasses.replace(t, **{k: fixed + max(0.0, getattr(t, k) - fixed) * share
                                         for k in ("median_s", "min_s", "max_s")})
    return grown(at), grown(one)


def _tp(tu: TPUnit | None, r: float) -> TPUnit | None:
    if tu is None:
        return None
    # split_flops holds the attention core's (compute.tp_split takes it out of the products')
    return dataclasses.replace(tu, core_flops=round(tu.core_flops * r * r),
                               split_flops=round(_two_parts(tu.split_flops, tu.core_flops, r)),
                               **{k: round(getattr(tu, k) * r) for k in _TP_LINEAR})


def _sequence_dims(g: Gemm, seq_len: int) -> int:
    return sum(d == seq_len for d in (g.m, g.n, g.k))


def _work(w: WorkCounts | None, r: float, *, tokens: int, seq_len: int, backward: bool) -> WorkCounts | None:
    if w is None:
        return None
    gemms: list[Gemm] = []
    for g in w.gemms:
        gemms.extend(_gemm(g, r, tokens=tokens, seq_len=seq_len, backward=backward))
    return WorkCounts(gemms=tuple(gemms), attention_flops=round(w.attention_flops * r * r),
                      other_flops=round(w.other_flops * r), memory_bytes=round(w.memory_bytes * r),
                      kernels=w.kernels)


def _gemm(g: Gemm, r: float, *, tokens: int, seq_len: int, backward: bool) -> list[Gemm]:
    """`g` at the new length (module doc). A forward's products run over the tokens (rows). A backward product
    whose rows and depth both equal the tokens is as often an input gradient (rows) as a weight gradient (depth)
    of a layer `tokens` wide: half of each."""
    def grown(d: int) -> int:
        return round(d * r)
    per_token = g.batch == 1
    want = tokens if per_token else seq_len
    if backward and g.m == want and g.k == want and g.count > 1:
        rows = (g.count + 1) // 2
        return [dataclasses.replace(g, m=grown(g.m), count=rows),
                dataclasses.replace(g, k=grown(g.k), count=g.count - rows)]
    for dim in ("m", "k", "n"):
        if getattr(g, dim) == want:
            return [dataclasses.replace(g, **{dim: grown(getattr(g, dim))})]
    return [g]
