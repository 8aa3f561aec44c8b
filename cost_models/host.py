"""This process's memory as the host sees it (the probe's rank baseline, the executor's peak on CPU ranks)."""
from __future__ import annotations

import resource


def peak_rss_bytes() -> tuple[int, str]:
    """This process's own peak RSS. Linux keeps getrusage's ru_maxrss across execve (the kernel folds the old
    address space's high-water mark into the process's maxrss), so a rank the launcher spawned would report the
    launcher's peak if it was larger (measured: a child of an 800 MiB parent reads 813 MiB there, VmHWM 13 MiB);
    /proc/self/status's VmHWM belongs to this address space alone (proc(5)). ru_maxrss where there is no /proc."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024, "peak RSS (VmHWM)"
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "peak RSS (getrusage ru_maxrss)"
