"""Counting one pass's work by kind (cost_models.records.work.WorkCounts) as the ops are dispatched: matrix products
by shape, fused attention FLOPs (halved under a causal mask, which the kernels skip), the bytes every other kernel
reads and writes, and the kernels launched. Views and reshapes launch nothing and move nothing. Runs on meta
tensors as on real ones: only shapes and dtypes are read."""
from __future__ import annotations

from typing import Any

import torch
from torch.utils.flop_counter import flop_registry

from cost_models.profiling.flops import CPU_FLASH_FLOPS
from cost_models.records.work import Gemm, WorkCounts
from cost_models.torch_compat.torch_private import NO_KERNEL_OPS, TorchDispatchMode, op_argument, tree_leaves

_aten = torch.ops.aten
_MM = {_aten.mm: (0, 1), _aten.addmm: (1, 2), _aten.bmm: (0, 1), _aten.baddbmm: (1, 2)}   # operand positions


def _tensors(values: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(values) if isinstance(t, torch.Tensor)]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class WorkCounter(TorchDispatchMode):
    """Sums the work of every op dispatched while it is active (module doc); `counts()` gives the record."""

    def __init__(self) -> None:
        super().__init__()
        self._gemms: dict[tuple[int, int, int, int, int], int] = {}
        self.attention_flops = self.other_flops = self.memory_bytes = self.kernels = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func.overloadpacket
        if func.is_view or packet in NO_KERNEL_OPS:
            return out
        self.kernels += 1
        if packet in _MM:
            a, b = (args[i] for i in _MM[packet])
            batch = a.shape[0] if a.dim() == 3 else 1
            key = (a.shape[-2], b.shape[-1], a.shape[-1], batch, a.element_size())
            self._gemms[key] = self._gemms.get(key, 0) + 1
        elif "attention" in str(packet):   # SDPA's fused kernels, whatever the backend
            flops = self._flops(packet, args, kwargs, out)
            self.attention_flops += flops // 2 if op_argument(func, "is_causal", args, kwargs, False) else flops
        elif packet in flop_registry:
            self.other_flops += self._flops(packet, args, kwargs, out)
        elif packet is _aten.embedding:   # reads the rows it gathers, not the whole table
            self.memory_bytes += 2 * sum(_nbytes(t) for t in _tensors(out)) + _nbytes(args[1])
        else:
            self.memory_bytes += sum(_nbytes(t) for t in _tensors((args, kwargs)) + _tensors(out))
        return out

    @staticmethod
    def _flops(packet, args, kwargs, out) -> int:
        formula = flop_registry.get(packet) or CPU_FLASH_FLOPS.get(packet)
        return int(formula(*args, **kwargs, out_val=out)) if formula else 0

    def counts(self) -> WorkCounts:
        return WorkCounts(gemms=tuple(Gemm(m=m, n=n, k=k, batch=b, count=c, itemsize=i)
                                      for (m, n, k, b, i), c in sorted(self._gemms.items())),
                          attention_flops=self.attention_flops, other_flops=self.other_flops,
                          memory_bytes=self.memory_bytes, kernels=self.kernels)
