"""Wall time of the default local cluster probe (4 ranks here, 4 KiB..64 MiB; target <= 60 s on this machine),
with the fitted alpha, bandwidth and R^2 of every collective. Prints a table, writes results/cluster_probe_speed.json."""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT))
from cost_models.records.formatting import duration  # noqa: E402  (after the path: the script runs from a checkout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ranks", type=int, default=None, help="default: the probe's own default (GPUs, or 4 CPU ranks)")
    args = ap.parse_args()
    cmd = [sys.executable, "-m", "cli", "profile-cluster", "--cluster", "local", "--dtype", "fp32", "-o", "-", "--json"]
    if args.ranks:
        cmd += ["--ranks", str(args.ranks)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"probe failed: {proc.stderr.strip()}")
    cluster = json.loads(proc.stdout)["cluster"]
    print(f"default probe: {cluster['nodes'] * cluster['devices_per_node']} ranks, "
          f"wall {wall:.1f} s (target <= 60 s: {'met' if wall <= 60 else 'MISSED'})")
    print(f"{'collective':<15} {'ranks':>5} {'alpha':>10} {'GB/s':>8} {'R^2':>6}")
    rows = []
    for f in cluster["fits"]:
        bw = 1 / f["beta_s_per_byte"] / 1e9 if f["beta_s_per_byte"] > 0 else 0.0
        rows.append({"op": f["op"], "group_size": f["group_size"], "alpha_s": f["alpha_s"], "bandwidth_GBps": bw, "r2": f["r2"]})
        print(f"{f['op']:<15} {f['group_size']:>5} {duration(f['alpha_s']):>10} {bw:>8.3f} {f['r2']:>6.3f}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "cluster_probe_speed.json").write_text(json.dumps({
        "schema_version": 1, "kind": "zeropipe.benchmark.cluster_probe_speed", "wall_s": round(wall, 2),
        "target_s": 60, "fits": rows, "compute": cluster.get("compute"), "notes": cluster.get("notes"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}, indent=2) + "\n")


if __name__ == "__main__":
    main()
