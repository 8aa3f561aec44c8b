"""The profiler's progress report: the share of the expected time done, weighted by each module's forward FLOPs in
the counting pass and by its counted seconds in the timed runs (Progress), and the callback it reports to."""
from __future__ import annotations

from typing import Callable

ProgressFn = Callable[[int, int, str], None]


class Progress:
    """Progress as a share of the expected time, reported as (done, total) parts with a total fixed from the start.

    Units differ in size (an embedding lookup against a block's matmuls, a head with a large vocabulary's loss),
    so a count of units gives a wrong time estimate. Work goes in two passes: every module is first run once,
    forward and backward, to count FLOPs and bytes; then (real mode) timed, (warmup + repeats) runs at the
    micro-batch and as many on one sample. The counting pass is weighted by forward FLOPs (known from the
    whole-model forward before it) and given its share of the time: one run of each module against the timed
    runs, so 1 / (1 + runs). It also measures each module's forward + backward in seconds, which weighs the timed
    runs and says how long they will take. FLOPs alone mislead there: the counter misses the loss, and CPU bf16
    backward runs far below the forward's FLOP rate: from the whole-model forward the timed runs of a CPU bf16
    profile were predicted at a small fraction of what they took, from the counting pass's seconds within a few
    percent (measured: benchmarks/results/measurements.md, "Profiler progress estimate")."""

    TOTAL = 1_000_000

    def __init__(self, flops: dict[str, int], *, timed: bool, warmup: int, repeats: int, batch: int,
                 on_progress: ProgressFn | None) -> None:
        # modules without matmuls (lookups, norms) still move the bar: at least 1% of the mean module's FLOPs
        floor = max(1, sum(flops.values()) // max(1, len(flops)) // 100)
        self.weight = {m: max(f, floor) for m, f in flops.items()}
        # timed runs per module in units of one run at the micro-batch (a one-sample run counts 1 / batch)
        self.runs = (warmup + repeats) * (1 + (1 / batch if batch > 1 else 0)) if timed else 0.0
        self.counting_share = 1 / (1 + self.runs)
        self.seconds: dict[str, float] = {}
        self._report, self._counted, self._timed, self._timed_total = on_progress, 0.0, 0.0, 0.0
        self.name = ""

    def _emit(self) -> None:
        if self._report:
            share = self.counting_share * self._counted / sum(self.weight.values())
            if self._timed_total:
                share += (1 - self.counting_share) * self._timed / self._timed_total
            self._report(min(self.TOTAL, round(share * self.TOTAL)), self.TOTAL, self.name)

    def unit(self, name: str) -> None:
        self.name = name
        self._emit()

    def counted(self, module: str, seconds: float) -> None:
        self._counted += self.weight[module]
        self.seconds[module] = seconds
        self._emit()

    def timing_starts(self) -> float:
        """Seconds the timed runs should take, from the counting pass's forward + backward of each module."""
        self._timed_total = sum(self.seconds.values()) * self.runs
        return self._timed_total

    def tick(self, module: str, share: float) -> None:
        self._timed += self.seconds[module] * share
        self._emit()

    def done(self) -> None:
        self.name, self._counted, self._timed = "done", sum(self.weight.values()), self._timed_total
        self._emit()
