"""Rank start-up: `planner run` of a tiny model (gpt-tiny, 8 steps) with ranks spawned (torch's default: every rank
a fresh interpreter importing torch and zeropipe) against ranks forked by multiprocessing's fork server (one
interpreter imports them once per launcher: cost_models.torch_compat.elastic.rank_start_method), at 2 and 4 ranks.
Interleaved and repeated (--repeats); prints each as median [min - max] of the command's wall time, the ranks'
measured peak RSS, and the machine's 1-minute load beside it. Writes results/rank_start.json."""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
METHODS = ("spawn", "forkserver")


def _planner(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-c", "import cli; cli.main()", *args], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, **(env or {})}, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"planner {' '.join(args)} failed: {done.stderr.strip()[-500:]}")
    return done


def _one(plan: Path, method: str) -> dict:
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    done = _planner("run", str(plan), "--steps", "8", "--warmup", "2", "-o", "-", "--json",
                    env={"ZEROPIPE_START_METHOD": method})
    wall = time.perf_counter() - t0
    run = json.loads(done.stdout)
    return {"method": method, "wall_s": round(wall, 3), "load_1min": round(load, 2),
            "peak_rss_mib": [round(r["peak_memory_bytes"] / 2**20, 1) for r in run["ranks"]],
            "losses": run["losses"]}


def _row(runs: list[dict]) -> str:
    walls = [r["wall_s"] for r in runs]
    rss = [statistics.median(r["peak_rss_mib"]) for r in runs]
    loads = [r["load_1min"] for r in runs]
    return (f"{statistics.median(walls):6.2f} s [{min(walls):.2f} - {max(walls):.2f}]   peak RSS per rank "
            f"{statistics.median(rss):5.0f} MiB   load {min(loads):.1f}-{max(loads):.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3, help="runs per start method and rank count, interleaved")
    args = ap.parse_args()
    out: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        prof = Path(tmp) / "profile.json"
        _planner("profile", "-m", "gpt-tiny", "-b", "1", "-s", "16", "--ranks", "4", "--probe-sizes", "64K,1M",
                 "--repeats", "2", "-o", str(prof))
        for ranks in (2, 4):
            plan = Path(tmp) / f"plan{ranks}.json"
            _planner("estimate", str(prof), "--dp", str(ranks), "--zero", "1", "-o", str(plan))
            for _ in range(args.repeats):
                for method in METHODS:
                    out.setdefault(f"{ranks} ranks, {method}", []).append(_one(plan, method))
    print(f"planner run, gpt-tiny, 8 steps, ZeRO-1 (wall time of the command; {os.cpu_count()} CPUs)")
    for name, runs in out.items():
        print(f"  {name:22s} {_row(runs)}")
    same = all(len({json.dumps(r['losses']) for r in out[f'{n} ranks, {m}']} | {
        json.dumps(r['losses']) for r in out[f'{n} ranks, spawn']}) == 1 for n in (2, 4) for m in METHODS)
    print(f"  losses identical across start methods: {same}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    record = {"benchmark": "rank_start", "created_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "host": platform.node(), "cpus": os.cpu_count(), "repeats": args.repeats, "same_losses": same,
              "runs": out}
    (RESULTS / "rank_start.json").write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {RESULTS / 'rank_start.json'}")


if __name__ == "__main__":
    main()
