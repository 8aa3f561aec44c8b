"""Human-readable summaries of a model profile (rows of strings; the CLI renders them with rich)."""
from __future__ import annotations

from cost_models.profile import ModelProfile, UnitProfile


def _ms(t) -> str:
    return "-" if t is None else f"{t.median_s * 1e3:.2f}"


def unit_rows(profile: ModelProfile, *, max_rows: int = 16) -> list[list[str]]:
    """One row per unit (the middle of a long block list elided), then a totals row."""
    def row(u: UnitProfile) -> list[str]:
        tied = " (tied)" if u.shared_params else ""
        return [u.name, f"{u.params:,}{tied}", f"{u.fwd_flops / 1e9:,.3f}", f"{u.bwd_flops / 1e9:,.3f}",
                f"{u.output_bytes / 2**20:,.2f}", f"{u.saved_bytes / 2**20:,.2f}", _ms(u.fwd_time), _ms(u.bwd_time)]
    units = list(profile.units)
    rows = [row(u) for u in units]
    if len(rows) > max_rows:
        keep = max_rows // 2
        rows = rows[:keep] + [[f"... {len(rows) - 2 * keep + 1} more units ..."] + [""] * 7] + rows[-keep + 1:]
    fwd_t = [u.fwd_time for u in units]
    total_time = (lambda ts: "-" if any(t is None for t in ts) else f"{sum(t.median_s for t in ts) * 1e3:.2f}")
    rows.append(["total", f"{profile.total_params:,}", f"{sum(u.fwd_flops for u in units) / 1e9:,.3f}",
                 f"{sum(u.bwd_flops for u in units) / 1e9:,.3f}", "", f"{sum(u.saved_bytes for u in units) / 2**20:,.2f}",
                 total_time(fwd_t), total_time([u.bwd_time for u in units])])
    return rows


UNIT_COLUMNS = ["unit", "params", "fwd GFLOP", "bwd GFLOP", "out MiB", "saved MiB", "fwd ms", "bwd ms"]
