"""What one unit's forward or backward asks of a GPU, by kind of work (the profile's record of it): the matrix
products by shape, the fused attention kernels' FLOPs, the bytes that memory-bound operations (norms, activations,
residual adds, dropout, casts, the loss) read and write, and the kernels launched. cost_models.cost.kernels prices
each kind at its own rate; profiling.work_counter counts them."""
from __future__ import annotations

from cost_models.records.base import Record, record


@record
class Gemm(Record):
    """`count` matrix products of one shape: `batch` independent (m x k) @ (k x n) products each (bmm; 1 for mm),
    operands of `itemsize` bytes."""

    m: int
    n: int
    k: int
    batch: int = 1
    count: int = 1
    itemsize: int = 2

    @property
    def flops(self) -> int:
        return 2 * self.batch * self.m * self.n * self.k * self.count


@record
class WorkCounts(Record):
    """One pass (forward or backward) of one unit at the profile's micro-batch, by kind of work."""

    gemms: tuple[Gemm, ...] = ()
    attention_flops: int = 0   # FLOPs the fused attention kernels execute: causal masks skip half (what the kernels'
                               # own benchmarks count), unlike torch's FLOP formulas, which count the whole square
    other_flops: int = 0       # FLOPs of counted ops that are neither products nor attention (convolutions)
    memory_bytes: int = 0      # bytes read + written by every other kernel (views and reshapes move nothing)
    kernels: int = 0           # kernels launched (ops that are not views)

    @property
    def gemm_flops(self) -> int:
        return sum(g.flops for g in self.gemms)

    def plus(self, other: WorkCounts) -> WorkCounts:
        """Both passes' work: products of one shape merged."""
        merged: dict[tuple[int, int, int, int, int], int] = {}
        for g in self.gemms + other.gemms:
            key = (g.m, g.n, g.k, g.batch, g.itemsize)
            merged[key] = merged.get(key, 0) + g.count
        return WorkCounts(gemms=tuple(Gemm(m=m, n=n, k=k, batch=b, count=c, itemsize=i)
                                      for (m, n, k, b, i), c in sorted(merged.items())),
                          attention_flops=self.attention_flops + other.attention_flops,
                          other_flops=self.other_flops + other.other_flops,
                          memory_bytes=self.memory_bytes + other.memory_bytes, kernels=self.kernels + other.kernels)
