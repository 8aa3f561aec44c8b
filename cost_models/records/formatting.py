"""Every number zeropipe prints with a unit: times, byte sizes and rates.

The adaptive formatters (duration, size, rate, flop_rate) pick the unit that keeps three significant digits, so a
40 µs step prints as "40.0 µs", never "0.0 ms", and 50 KiB as "50.0 KiB", never "0.00 MiB". `fixed` prints in a
given unit: for table columns whose header names the unit, and for numbers set side by side to be compared.
Bytes use binary units (KiB = 2^10 B ... GiB = 2^30 B), rates decimal ones (1 GB/s = 1e9 B/s), as the README's
conventions say.
"""
from __future__ import annotations

import datetime as dt
import math

KIB, MIB, GIB = 2**10, 2**20, 2**30

_BYTES = ((GIB, "GiB"), (MIB, "MiB"), (KIB, "KiB"), (1, "B"))
_RATES = ((1e12, "TB/s"), (1e9, "GB/s"), (1e6, "MB/s"), (1e3, "kB/s"), (1, "B/s"))
_FLOP_RATES = ((1e15, "PFLOP/s"), (1e12, "TFLOP/s"), (1e9, "GFLOP/s"), (1e6, "MFLOP/s"), (1, "FLOP/s"))
_FIXED = {unit: scale for scale, unit in _BYTES + _RATES + _FLOP_RATES} | {
    "GFLOP": 1e9, "GB": 1e9, "s": 1.0, "ms": 1e-3, "µs": 1e-6}


def _significant(value: float, digits: int) -> str:
    """`value` (already rounded to `digits` significant digits) without an exponent: 22.0, 0.100, 1,230."""
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(value)))) if value else digits - 1
    return f"{value:,.{decimals}f}"


def duration(seconds: float, digits: int = 3) -> str:
    """A duration in the unit that keeps it readable, `digits` significant digits: 22.0 ns, 25.0 µs, 0.100 ms,
    12.3 ms, 1.50 s, 1,234 s (from 1,000 on, all integer digits). The one formatter for every time the CLI and the
    reports print, so a 20 µs step is not shown as "0.0 ms"."""
    if not math.isfinite(seconds):
        return f"{seconds} s"
    if seconds == 0:
        return "0 ms"
    if abs(seconds) < 1e-10:   # below 0.1 ns nothing is measured; print it exactly rather than as 0.0000220 ns
        return f"{seconds:.{digits}g} s"
    rounded = float(f"{seconds:.{digits}g}")   # round first, so 0.99996 s is "1.00 s", not "1,000 ms"
    mag = abs(rounded)
    scale, unit = ((1e9, "ns") if mag < 1e-7 else (1e6, "µs") if mag < 1e-4 else (1e3, "ms") if mag < 1
                   else (1.0, "s"))
    return f"{_significant(float(f'{rounded * scale:.{digits}g}'), digits)} {unit}"


def about(seconds: float) -> str:
    """A rough duration for "this will take ..." lines: about 40 s, about 12 min, about 2.5 h."""
    if seconds < 90:
        return f"about {seconds:.0f} s"
    return f"about {seconds / 60:.0f} min" if seconds < 5400 else f"about {seconds / 3600:.1f} h"


def _adaptive(value: float, units: tuple[tuple[float, str], ...], digits: int = 3) -> str:
    """`value` in the largest of `units` (scale, name; largest first) where it is at least 1 after rounding."""
    smallest = units[-1][1]
    if not math.isfinite(value):
        return f"{value} {smallest}"
    if value == 0:
        return f"0 {smallest}"
    for scale, unit in units:
        shown = float(f"{value / scale:.{digits}g}")
        if abs(shown) >= 1 or scale == 1:
            if scale == 1 and float(value).is_integer():
                return f"{int(value):,} {unit}"   # whole bytes (or B/s) need no decimals
            return f"{_significant(shown, digits)} {unit}"
    raise AssertionError("unreachable: the last unit has scale 1")


def size(n_bytes: float) -> str:
    """Bytes in B, KiB, MiB or GiB, three significant digits: 512 B, 40.0 KiB, 1.50 MiB, 12.3 GiB."""
    return _adaptive(n_bytes, _BYTES)


def rate(bytes_per_s: float) -> str:
    """A bandwidth in decimal units: 900 MB/s, 25.0 GB/s."""
    return _adaptive(bytes_per_s, _RATES)


def flop_rate(flops_per_s: float) -> str:
    """A compute rate: 240 GFLOP/s, 989 TFLOP/s."""
    return _adaptive(flops_per_s, _FLOP_RATES)


def fixed(value: float, unit: str, decimals: int = 2, *, show_unit: bool = True) -> str:
    """`value` (bytes, B/s, FLOP/s, FLOPs or seconds) in one given unit with thousands separators: for a column
    whose header names the unit (show_unit=False) and for numbers a reader compares digit by digit."""
    text = f"{value / _FIXED[unit]:,.{decimals}f}"
    return f"{text} {unit}" if show_unit else text


def measured(value: float, unit: str) -> str:
    """A predicted or measured quantity of a run, by its unit: seconds adaptive, bytes in MiB to three decimals
    (the rows of one run set predictions beside measurements, so they share a unit), ratios as x1.234."""
    if unit == "s":
        return duration(value)
    if unit == "B":
        return fixed(value, "MiB", 3)
    if unit == "x":   # a ratio (a load over its mean)
        return f"x{value:.3f}"
    raise ValueError(f"no format for unit {unit!r}")


def now_utc() -> str:
    """The timestamp every zeropipe file records (created_at): UTC, ISO 8601, whole seconds."""
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def load_line(load_1min: tuple[float, ...], cpus: int, ranks: int) -> str:
    """How loaded the machine was during a run (its 1-minute load average, os.getloadavg, at the start and the end),
    so a noisy measurement on a shared machine is not read as a bad prediction."""
    lo, hi = min(load_1min), max(load_1min)
    verdict = ("more runnable work than CPUs at times: measured times include waiting for a core"
               if hi > cpus else "below the CPU count: the measured times are the plan's own")
    return (f"machine load during the run (1-minute average): {lo:.1f} to {hi:.1f} on {cpus} CPUs with {ranks} "
            f"ranks; {verdict}")
