"""Per-rank memory: model states by ZeRO stage, activations by schedule, buffers and overhead (pure functions).

Model states per parameter: cost_models.records.precision.BYTES_PER_PARAM (Rajbhandari et al. 2020, "ZeRO",
sections 3.1 and 5). ZeRO over N data-parallel ranks divides: stage 1 the optimizer states, stage 2 also the gradients,
stage 3 also the parameters: per rank (mixed Adam) 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N (zero_model_state_bytes: the
paper's formula, Figure 1).

ZeRO-2 as the executor runs it holds 2Ψ + 16Ψ/N at its peak, not the paper's 2Ψ + 14Ψ/N: FSDP2 keeps every
parameter's shard (2Ψ/N) as the optimizer's parameter and, with reshard_after_forward=False, the gathered copy (2Ψ)
beside it from forward to backward, where DeepSpeed's ZeRO-2 keeps one replicated copy and no shard. The extra term
is exactly P·Ψ/N (P = parameter bytes: 2 in bf16-mixed, 4 in fp32); tests/test_memory_model.py checks it, and the
executor's measured parameter bytes (the local shard) equal executor_state_bytes (tests/test_executor.py).

What the executor really holds (the mapping's approximations, stated in the report). The executor runs ZeRO-2
and ZeRO-3 with FSDP2, which keeps parameters sharded at rest in both, so `executor_state_bytes` counts ZeRO-2's
parameters as sharded and puts the gathered copy among the buffers (DeepSpeed's ZeRO-2 keeps them replicated:
the same bytes under another label). Buffers, the unsharded tensors FSDP2 holds while computing:
  * ZeRO-3 without a pipeline gathers one unit at a time and prefetches the next: 2 x the largest unit's
    parameters and 1 x its gradients (before reduce-scatter);
  * ZeRO-2 without a pipeline (reshard_after_forward=False) keeps every gathered parameter from forward to
    backward: the full parameters, and one unit's gradients;
  * under a pipeline, torch's stage defers FSDP gradient sync to the end of the step, so ZeRO-2/3 stages hold
    the unsharded parameters and gradients of the whole stage while micro-batches run.
Also among the buffers: torch.autocast's bf16 weight copies under mixed precision (autocast_copy_bytes), and the
largest transient a rank's units allocate in forward + backward beyond what they keep (an LM head's float logits
and their gradient; measured by the profiler on GPUs, profile.UnitProfile.transient_bytes).
Overhead: a fixed per-process amount: on CPU ranks the probe's measured rank baseline plus the executor's imports
(overhead_bytes), else OVERHEAD_BYTES by device kind.

Tensor parallelism over t ranks (Shoeybi et al. 2019, "Megatron-LM", section 3): the parameters of the split
linears (and of a vocabulary-split embedding and head) are divided by t, so is everything ZeRO then divides by dp
(tp_param_share). Activations per layer (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", section 4 and Table 2; s sequence, b micro-batch, h hidden, a heads, 16-bit activations):
    no parallelism                  sbh(34 + 5as/h)
    tensor parallel                 sbh(10 + 24/t + 5as/(ht))
    tensor + sequence parallel      sbh(34/t + 5as/(ht))
    tensor parallel + selective     sbh(10 + 24/t)
    tensor + sequence + selective   34sbh/t
(korthikanti_layer_bytes). The estimate applies the same split to the bytes the profiler measured by role
(profile.TPUnit, tp_saved_bytes), so it holds for any block the plans cover, not only Megatron's GPT.
"""
from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

from cost_models.records.base import Record, record
from cost_models.records.precision import BYTES_PER_PARAM
from cost_models.records.profile import TPUnit, UnitProfile

if TYPE_CHECKING:
    from cost_models.records.cluster import ClusterProfile

GB = 1e9
# bf16-mixed as the executor runs it on GPUs without a pipeline (executor.zero.mixed_precision, torchtitan's
# recipe): the fp32 parameters are the master weights and each gradient takes its parameter's dtype, so the
# optimizer holds only its moments. The same 16 (Adam) and 12 (SGD) bytes as the paper's split; the bf16 copies
# compute uses are buffers (FSDP2's gathered parameters, autocast's cast weights: autocast_copy_bytes).
TORCH_MIXED_BYTES: dict[str, tuple[int, int, int]] = {"adamw": (4, 4, 8), "adam": (4, 4, 8), "sgd": (4, 4, 4)}
# Per-process overhead. GPU: CUDA context, cuBLAS/cuDNN workspaces and NCCL buffers, about 1 GiB in practice
# (PyTorch "CUDA semantics" notes; nvidia-smi shows ~0.5 GiB for an idle context). CPU: a gloo rank's peak RSS after
# importing the executor and init_process_group, ~300 MiB on torch 2.13 (measured by tests/test_memory_model.py,
# test_cpu_overhead_is_a_gloo_ranks_rss_before_any_model).
OVERHEAD_BYTES = {"gpu": 2**30, "cpu": 310 * 2**20}
# An executor rank imports more than a probe rank before either holds a tensor (executor, planner and their
# dependencies): one gloo rank's RSS after init_process_group with executor.train imported less the same with
# cost_models.profiling.cluster_probe, torch 2.13 CPU (tests/test_memory_model.py measures both; figures in
# benchmarks/results/measurements.md, "CPU rank memory baseline").
EXECUTOR_IMPORTS_BYTES = 78 * 2**20


def overhead_bytes(cluster: "ClusterProfile") -> float:
    """A rank's fixed bytes: on CPU ranks the probe's measured rank baseline plus the executor's imports where the
    cluster was probed (the constant misses other builds of torch: a CUDA build's CPU ranks measured twice it,
    benchmarks/results/measurements.md, "CPU rank memory baseline"), else OVERHEAD_BYTES by device kind."""
    probe = cluster.compute
    if cluster.device.kind == "cpu" and probe is not None and probe.rank_rss_bytes > 0:
        return probe.rank_rss_bytes + EXECUTOR_IMPORTS_BYTES
    return OVERHEAD_BYTES[cluster.device.kind]


@record
class MemoryBreakdown(Record):
    """Bytes one rank holds at its peak, by category (conventions: bytes; the report prints GiB = 2^30)."""

    rank: int
    stages: tuple[int, ...]
    parameters: int
    gradients: int
    optimizer_states: int
    activations: int
    buffers: int
    overhead: int

    @property
    def total_bytes(self) -> int:
        return (self.parameters + self.gradients + self.optimizer_states + self.activations + self.buffers
                + self.overhead)

    def to_dict(self) -> dict:
        return {**super().to_dict(), "total_bytes": self.total_bytes}

    @classmethod
    def from_dict(cls, data: dict) -> "MemoryBreakdown":
        return super().from_dict({k: v for k, v in data.items() if k != "total_bytes"})


def zero_model_state_bytes(psi: float, n: int, zero: int, precision: str = "bf16-mixed", optimizer: str = "adamw",
                           *, per_param: tuple[int, int, int] | None = None) -> tuple[float, float, float]:
    """(parameters, gradients, optimizer states) bytes per rank for psi parameters under ZeRO-`zero` over n ranks
    (`per_param`: another split than the paper's, held_bytes_per_param)."""
    p, g, k = per_param or BYTES_PER_PARAM[(precision, optimizer)]
    return (psi * p / (n if zero >= 3 else 1), psi * g / (n if zero >= 2 else 1), psi * k / (n if zero >= 1 else 1))


def torch_mixed(precision: str, device_kind: str, pp: int) -> bool:
    """Whether the executor runs this plan in torch's mixed precision (fp32 master parameters, bf16 compute):
    bf16-mixed on GPUs without a pipeline (executor.zero.mixed_precision). Elsewhere the paper's bytes stand: CPU
    ranks run fp32, and GPU pipelines plain bf16, which holds less than they are charged (README, Fidelity)."""
    return precision == "bf16-mixed" and device_kind == "gpu" and pp == 1


def held_bytes_per_param(precision: str, optimizer: str, *, mixed: bool = False) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer state) bytes per parameter as the executor holds them (`mixed`: torch_mixed)."""
    return TORCH_MIXED_BYTES[optimizer] if mixed else BYTES_PER_PARAM[(precision, optimizer)]


def executor_state_bytes(psi: float, n: int, zero: int, precision: str = "bf16-mixed",
                         optimizer: str = "adamw", *, mixed: bool = False) -> tuple[float, float, float]:
    """Model states as the executor holds them at rest: FSDP2 shards ZeRO-2's parameters too (module doc), so ZeRO-2
    is (P + G + K)Ψ/N here and its gathered PΨ is counted by comm_buffer_bytes: 2Ψ + 16Ψ/N in all for mixed Adam,
    PΨ/N more than the paper's 2Ψ + 14Ψ/N. `mixed` (torch_mixed): torch's split of the same bytes."""
    return zero_model_state_bytes(psi, n, 3 if zero == 2 and n > 1 else zero, precision, optimizer,
                                  per_param=held_bytes_per_param(precision, optimizer, mixed=mixed))


def autocast_copy_bytes(stage_params: float, *, autocast: bool) -> float:
    """torch.autocast's bf16 copies of the weights (mixed precision where FSDP2 does not cast: ZeRO-0/1, or one
    data-parallel rank): each weight a forward casts is cached until the forward ends and saved for its backward,
    2 bytes per parameter (an upper bound: norms and biases are not cast)."""
    return 2.0 * stage_params if autocast else 0.0


def zero1_partition(numels: list[int], n: int) -> list[int]:
    """Parameters each of n ranks owns under torch's ZeroRedundancyOptimizer: whole tensors, largest first, each
    to the rank with the fewest so far, the lowest rank on a tie (its _partition_parameters). One huge tensor (an
    embedding) can leave the ranks far from Psi/n each.

    Returns the shares of ranks 0 .. min(n, len(numels)) - 1 only: the ranks beyond own nothing (a rank r is
    first chosen only once ranks 0..r-1 each hold a tensor, so r < len(numels)). A heap over those bins keyed
    (size, rank) makes the same choices as torch's linear scan, in O(T log T) for T tensors whatever n is."""
    heap = [(0, r) for r in range(min(n, len(numels)))]
    sizes = [0] * len(heap)
    for numel in sorted(numels, reverse=True):
        size, r = heap[0]
        sizes[r] = size + numel
        heapq.heapreplace(heap, (sizes[r], r))
    return sizes


def comm_buffer_bytes(*, stage_params: float, largest_unit_params: float, zero: int, pp: int, dp: int,
                      param_bytes: int, grad_bytes: int, held_whole: bool = False) -> float:
    """Unsharded parameter/gradient buffers the FSDP2 mapping holds beyond the sharded states (module doc).
    `held_whole`: parameters and gradients stay whole through the step, as a pipeline's FSDP2 stages hold them (the
    distributed optimizer, executor.zero)."""
    if dp == 1 or zero < 2:
        return 0.0  # DDP with gradient_as_bucket_view: grads live in the buckets, no second copy
    if pp > 1 or held_whole:
        return stage_params * (param_bytes + grad_bytes)
    if zero == 2:
        return stage_params * param_bytes + largest_unit_params * grad_bytes
    return largest_unit_params * (2 * param_bytes + grad_bytes)


def korthikanti_layer_bytes(*, s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False,
                            selective: bool = False) -> float:
    """Activation bytes one transformer layer keeps for backward, Korthikanti et al. 2022, Table 2 (module doc):
    16-bit activations, 1-byte dropout masks, a GPT block with dropout after attention and the MLP. At t = 1 the
    "tensor parallel" rows give the "no parallelism" ones (10 + 24 = 34)."""
    core = 0.0 if selective else 5 * a * s / (h * t)
    linear = 34 / t if sp else 10 + 24 / t
    return s * b * h * (linear + core)


def tp_param_share(params: float, tu: TPUnit | None, tp: int, vocab: bool) -> float:
    """Parameters one tensor-parallel rank holds of a unit's `params` (split ones / tp; the vocabulary-split ones
    only where the vocabulary splits at this tp: tensor_parallel.vocab_divides)."""
    if tu is None or tp == 1:
        return params
    return params - (tu.split_params + (tu.vocab_params if vocab else 0)) * (1 - 1 / tp)


def saved_at(u: UnitProfile, *, micro_batch_size: int, profile_batch: int, dtype_ratio: float = 1.0) -> float:
    """A unit's saved bytes at `micro_batch_size` and in a compute dtype `dtype_ratio` times the profile's element
    size, expressed at the profile's scale (times estimate.activation_scale, which scales by both, gives bytes).

    Four parts: what grows with the batch scales with it, the fixed part (UnitProfile.saved_fixed_bytes) does not;
    what is stored in the profile's dtype scales with the element size, the rest (saved_other_dtype_bytes: token
    ids, masks, a bf16 model's fp32 statistics) does not. Measured: gpt2-small's saved bytes grow 1.60x, not 2x,
    from a bf16 to an fp32 profile (2 x 64 tokens, meta), and an fp32 run of a bf16 profile's plan kept fewer
    activation bytes than 2x predicts (measured on an H200: benchmarks/results/measurements.md, "GPU
    observations"). Its least value over batches at the profile's dtype (a lower
    bound, for the search's pruning) is saved_bytes - saved_fixed_bytes. Not corrected by dtype: the parts a plan
    subtracts or keeps apart (tensor parallelism's roles, tp_saved_bytes; torch's split backward, split_kept_bytes),
    which scale by the element size whole."""
    grow, grow_other, fixed, fixed_other = saved_parts(u)
    batch_ratio = micro_batch_size / profile_batch
    return grow + grow_other / dtype_ratio + fixed / batch_ratio + fixed_other / (batch_ratio * dtype_ratio)


def saved_parts(u: UnitProfile) -> tuple[int, int, int, int]:
    """A unit's saved bytes at the profile's batch and dtype in saved_at's four parts: (growing with the batch in
    the profile's dtype, growing in another, fixed in the profile's dtype, fixed in another)."""
    fixed_other = u.saved_other_fixed_bytes
    grow_other = u.saved_other_dtype_bytes - fixed_other
    return (u.saved_bytes - u.saved_fixed_bytes - grow_other, grow_other, u.saved_fixed_bytes - fixed_other,
            fixed_other)


def tp_saved_bytes(saved: float, tu: TPUnit | None, *, tp: int, sp: bool, selective: bool,
                   vocab: bool = False, save_shard: bool = False) -> float:
    """Bytes one tensor-parallel rank keeps for backward of a unit that saves `saved` bytes at tp = 1, by role
    (profile.TPUnit; Korthikanti et al. 2022, section 4.2): the split region and the attention core / tp, norms and
    the residual-stream places / tp only under SP, inputs of column-split linears whole (under SP DTensor keeps
    the all-gathered input: sbh(4 - 4/t) more than Table 2's 34/t row), or / tp under SP with `save_shard` (the
    shard kept, as Megatron-LM: executor.sp_shard; a head that does not split on the vocabulary is a replicated
    region, its input whole), the attention core dropped by selective recompute, the loss's log-probabilities / tp
    where the vocabulary splits (`vocab`), anything else whole."""
    if tu is None:
        return saved
    core, logits, col = tu.saved_core, tu.saved_logits, float(tu.saved_col_input)
    roles = tu.saved_split + tu.saved_seq + col + core + logits
    if sp and save_shard:
        whole = 0 if vocab else min(col, tu.head_in_bytes)
        col = whole + (col - whole) / tp
    return (saved - roles + col + tu.saved_split / tp + tu.saved_seq / (tp if sp else 1)
            + (0.0 if selective else core / tp) + logits / (tp if vocab else 1))
