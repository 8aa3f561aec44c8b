"""Wall time and peak RSS of `planner profile --meta` on llama3-70b (target: <= 30 s and <= 2 GB here).

Runs the real CLI in a subprocess (so import time counts, as a user sees it), prints a table, and writes
benchmarks/results/profile_speed.json.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
sys.path.insert(0, str(RESULTS.parents[1]))
from cost_models.records.formatting import fixed  # noqa: E402  (after the path: the script runs from a checkout)


def run_once(model: str, seq_len: int) -> dict:
    cmd = [sys.executable, "-m", "cli", "profile", "--model", model, "-b", "1", "-s", str(seq_len), "--meta",
           "--dtype", "bf16", "--cluster", "none", "-o", "-", "--json"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"profiling failed: {proc.stderr.strip()}")
    # ru_maxrss of children is the largest child so far (KiB on Linux); each run is its own child.
    peak_kib = max(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, before)
    total = json.loads(proc.stdout)["model"]["total_params"]
    return {"model": model, "seq_len": seq_len, "wall_s": round(wall, 2), "peak_rss_bytes": peak_kib * 1024,
            "total_params": total}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="llama3-70b")
    ap.add_argument("--seq-len", type=int, default=4096)
    args = ap.parse_args()
    row = run_once(args.model, args.seq_len)
    targets = {"wall_s": 30.0, "peak_rss_bytes": 2e9}
    print(f"{'model':<12} {'seq':>6} {'params':>16} {'wall s':>8} {'peak RSS GB':>12}  target")
    print(f"{row['model']:<12} {row['seq_len']:>6} {row['total_params']:>16,} {row['wall_s']:>8.2f} "
          f"{fixed(row['peak_rss_bytes'], 'GB', 3, show_unit=False):>12}  <= 30 s, <= 2 GB: "
          f"{'met' if row['wall_s'] <= targets['wall_s'] and row['peak_rss_bytes'] <= targets['peak_rss_bytes'] else 'MISSED'}")
    RESULTS.mkdir(exist_ok=True)
    result = {"schema_version": 1, "kind": "zeropipe.benchmark.profile_speed", "rows": [row], "targets": targets,
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
              "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    (RESULTS / "profile_speed.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
