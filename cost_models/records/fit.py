"""Least-squares alpha-beta fits of collective timings: t(S) = alpha + beta * S."""
from __future__ import annotations

from typing import Sequence


def fit_alpha_beta(sizes: Sequence[float], times: Sequence[float]) -> tuple[float, float, float]:
    """Fit t = alpha + beta * S; return (alpha, beta, r2).

    Weighted least squares with weights 1/t^2, i.e. minimising the relative error: sizes span four orders of
    magnitude and an unweighted fit would ignore the latency-bound small messages. alpha and beta are kept
    non-negative (a negative latency is noise, not physics). r2 is computed on the unweighted times.
    """
    if len(sizes) != len(times) or len(sizes) < 2:
        raise ValueError("need at least two (size, time) samples")
    w = [1.0 / (t * t) for t in times]
    sw = sum(w)
    sx = sum(wi * x for wi, x in zip(w, sizes))
    sy = sum(wi * y for wi, y in zip(w, times))
    sxx = sum(wi * x * x for wi, x in zip(w, sizes))
    sxy = sum(wi * x * y for wi, x, y in zip(w, sizes, times))
    det = sw * sxx - sx * sx
    beta = (sw * sxy - sx * sy) / det if det else 0.0
    alpha = (sy - beta * sx) / sw
    if alpha < 0:   # refit through the origin
        alpha, beta = 0.0, sxy / sxx
    elif beta < 0:  # flat: pure latency
        alpha, beta = sy / sw, 0.0
    mean = sum(times) / len(times)
    ss_tot = sum((t - mean) ** 2 for t in times)
    ss_res = sum((t - (alpha + beta * x)) ** 2 for x, t in zip(sizes, times))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    return alpha, beta, r2
