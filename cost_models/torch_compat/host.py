"""This process's memory as the host sees it (the probe's rank baseline, the executor's peak on CPU ranks), and how
its C allocator hands memory back."""
from __future__ import annotations

import ctypes
import ctypes.util
import resource
import time
from typing import Callable

# glibc's mallopt(3) parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
KEEP_FREED_BELOW = 1 << 30   # blocks up to 1 GiB come from the heap and stay there when freed


def keep_freed_memory() -> bool:
    """Have glibc's malloc keep freed blocks for reuse instead of unmapping them: every CPU process that times or
    trains (the profile, the probe's ranks, the executor's ranks) calls it, so all of them compute at the same speed.

    glibc serves a block above its mmap threshold (dynamic, at most 32 MiB on 64-bit: mallopt(3)) with a fresh
    mmap and unmaps it on free, so the next step page-faults and zeroes it again. A logits tensor crosses that
    line at a large micro-batch, and its unit then took about twice what the profile's affine model of it (timed
    at a small micro-batch) says; with this, about what it says (measured: benchmarks/results/measurements.md,
    "glibc mmap threshold"). A no-op (False) where the C library is not glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = libc.mallopt if libc is not None else None
    except (OSError, AttributeError):
        return False
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, KEEP_FREED_BELOW)) and bool(mallopt(_M_TRIM_THRESHOLD, KEEP_FREED_BELOW))


def work_clock(*, on_cpu: bool, threads: int) -> Callable[[], float]:
    """The clock a profile times work with. Work that runs wholly on the calling thread (on CPU with one torch
    thread: intra-op work and the CPU autograd engine both run on the caller) is timed by that thread's CPU time
    (CLOCK_THREAD_CPUTIME_ID, clock_gettime(2)), which leaves out the time the thread waited for a core while
    another program's task ran, where the wall clock's repeats spread out under such load (measured:
    benchmarks/results/measurements.md, "Profiles under load"). The estimate prices that waiting itself
    (cost.sharing: other programs' runnable tasks share the cores). Wall time (perf_counter) where GPU kernels run
    asynchronously or other threads do part of the work."""
    return time.thread_time if work_clock_name(on_cpu=on_cpu, threads=threads) == "thread-cpu" else time.perf_counter


def work_clock_name(*, on_cpu: bool, threads: int) -> str:
    """ModelProfile.clock: "thread-cpu" or "wall", the clock work_clock picks."""
    return "thread-cpu" if on_cpu and threads == 1 else "wall"


def profile_clock() -> tuple[Callable[[], float], str]:
    """work_clock and its name for the profiler's timings in this process, one rule for all of them (units, the
    whole model, the optimizer, ModelProfile.clock): CPU work unless CUDA is initialized (a GPU profile, whose
    kernels run asynchronously), with torch's intra-op threads."""
    import torch
    on_cpu, threads = not torch.cuda.is_initialized(), torch.get_num_threads()
    return work_clock(on_cpu=on_cpu, threads=threads), work_clock_name(on_cpu=on_cpu, threads=threads)


def peak_rss_bytes() -> tuple[int, str]:
    """This process's own peak RSS. Linux keeps getrusage's ru_maxrss across execve (the kernel folds the old
    address space's high-water mark into the process's maxrss), so a rank the launcher spawned would report the
    launcher's peak if it was larger (measured: benchmarks/results/measurements.md, "Peak RSS across execve");
    /proc/self/status's VmHWM belongs to this address space alone (proc(5)). ru_maxrss where there is no /proc."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024, "peak RSS (VmHWM)"
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "peak RSS (getrusage ru_maxrss)"


def runnable_tasks(loadavg_text: str) -> int | None:
    """The tasks runnable right now, from /proc/loadavg's fourth field ("runnable/total", proc(5)), or None."""
    fields = loadavg_text.split()
    try:
        return int(fields[3].split("/")[0])
    except (IndexError, ValueError):
        return None


def background_runnable(samples: int = 21, interval_s: float = 0.02) -> float:
    """How many tasks besides this process compete for the cores now: the median over `samples` readings of the
    runnable count, less this process's own (Linux; 0.0 where /proc/loadavg cannot be read). The 1-minute load
    average lags a load that just started by a minute; this count does not."""
    import statistics
    counts = []
    for _ in range(samples):
        try:
            with open("/proc/loadavg", encoding="ascii") as fh:
                n = runnable_tasks(fh.read())
        except OSError:
            n = None
        if n is not None:
            counts.append(max(0, n - 1))
        time.sleep(interval_s)
    return float(statistics.median(counts)) if counts else 0.0
