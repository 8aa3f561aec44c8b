"""Grouped-query attention through torch's scaled_dot_product_attention: whether the kernel torch will pick reads
each key/value head for its group of query heads itself (enable_gqa), or needs them repeated first.

Torch 2.13's kernels (torch/_C sdp_utils, "check_batch_size_and_num_heads_dense"): the CPU flash kernel, CUDA's
flash kernel (fp16/bf16, compute capability 8.0 and up, no attention mask) and the math fallback take grouped K/V;
CUDA's memory-efficient kernel, the one that takes a mask and fp32, does not, so such a call would fall back to
the math kernel, which keeps the s x s scores. Repeating K/V there keeps the efficient kernel."""
from __future__ import annotations

import torch


def grouped_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
               masked: bool = False) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(k, v, enable_gqa) for an SDPA call of queries `q` over keys `k` and values `v` (b, heads, s, d): the K/V
    as they are with enable_gqa where the kernel torch picks takes them grouped (module doc), else repeated to the
    query's heads (Meta's Llama reference does this always) with enable_gqa off."""
    if k.shape[1] == q.shape[1]:
        return k, v, False
    if not q.is_cuda or (not masked and q.dtype in (torch.float16, torch.bfloat16)
                         and torch.cuda.get_device_capability(q.device)[0] >= 8):
        return k, v, True
    rep = q.shape[1] // k.shape[1]
    return k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1), False
