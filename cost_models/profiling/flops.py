"""FLOP counting for the profiler, and attention run as the fused kernels run it: torch's FlopCounterMode with
formulas for the CPU flash-attention kernels, grouped-query K/V repeated where torch's SDPA formula refuses them,
the attention kernels a count saw, and the meta-mode substitute of the fused CPU flash kernel for SDPA's math path."""
from __future__ import annotations

import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count, shape_wrapper

from cost_models.torch_compat.torch_private import CPU_FLASH_ATTENTION, CPU_FLASH_ATTENTION_BACKWARD


# torch's FlopCounterMode has no formula for the CPU flash-attention kernels, so it would count attention as 0.
# They compute the same products as the CUDA kernels; reuse torch's own SDPA formulas (4*b*s^2*h forward).
def _cpu_flash_fwd_flop(q, k, v, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(q, k, v)


def _cpu_flash_bwd_flop(grad_out, q, k, v, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out, q, k, v)


_FLOP_MAPPING = {
    CPU_FLASH_ATTENTION: _cpu_flash_fwd_flop,
    CPU_FLASH_ATTENTION_BACKWARD: _cpu_flash_bwd_flop,
}
# The same formulas over shapes, as torch's own registry holds them (profiling.work_counter calls them directly)
CPU_FLASH_FLOPS = {op: shape_wrapper(formula) for op, formula in _FLOP_MAPPING.items()}
_ATTENTION_OPS = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")


class FusedAttentionOnMeta(TorchFunctionMode):
    """On meta tensors, run F.scaled_dot_product_attention through the fused CPU flash kernel, not the math path."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k, v = args[:3]
            extra = dict(zip(("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"), args[3:]), **kwargs)
            # The CPU flash kernel takes grouped-query K/V (fewer heads) natively, as enable_gqa asks.
            if q.is_meta and extra.get("attn_mask") is None and (q.shape[1] == k.shape[1] or extra.get("enable_gqa")):
                return CPU_FLASH_ATTENTION(q, k, v, extra.get("dropout_p", 0.0), bool(extra.get("is_causal", False)),
                                           scale=extra.get("scale"))[0]
        return func(*args, **kwargs)


def _counts_gqa() -> bool:
    """Whether torch's SDPA FLOP formula takes grouped-query K/V (fewer heads than the query): torch 2.13's does;
    torch 2.11's asserts 'query/key/value shapes are incompatible' (seen profiling HF Llama, Mistral and Qwen2 on
    an H200 with torch 2.11)."""
    try:
        sdpa_flop_count((1, 4, 2, 8), (1, 2, 2, 8), (1, 2, 2, 8))
    except AssertionError:
        return False
    return True


COUNTS_GQA = _counts_gqa()


class _ExpandGQA(TorchFunctionMode):
    """For a torch whose FLOP formulas refuse grouped-query attention: give SDPA K/V repeated to the query's heads,
    which computes the same attention with the same FLOPs as the formulas count them where they take GQA. The
    counting pass then saves the repeated K/V: on such a torch a GQA model's saved bytes count K/V at the query's
    head count (an overestimate of that share)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is F.scaled_dot_product_attention and len(args) >= 3:
            q, k, v = args[:3]
            if k.shape[-3] != q.shape[-3] and q.shape[-3] % k.shape[-3] == 0:
                rep = q.shape[-3] // k.shape[-3]
                kwargs.pop("enable_gqa", None)
                args = (q, k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3), *args[3:7])
        return func(*args, **kwargs)


class _FlopCounter(FlopCounterMode):
    """FlopCounterMode with this module's formulas, repeating grouped-query K/V where torch cannot count them."""

    def __init__(self, expand_gqa: bool) -> None:
        super().__init__(display=False, custom_mapping=_FLOP_MAPPING)
        self._expand = _ExpandGQA() if expand_gqa else None

    def __enter__(self):
        if self._expand:
            self._expand.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            if self._expand:
                self._expand.__exit__(*exc)


def flop_counter() -> FlopCounterMode:
    return _FlopCounter(expand_gqa=not COUNTS_GQA)


def attention_ops(fc: FlopCounterMode) -> set[str]:
    return {str(op) for op in fc.get_flop_counts().get("Global", {}) if any(k in str(op) for k in _ATTENTION_OPS)}
