"""Planning speed: llama3-70b (meta profile) on dgx-h100 x 128 nodes (1,024 GPUs) and x 2,048 nodes (16,384 GPUs).
Target: <= 5 s for 1,024 GPUs on this machine. Prints a table and writes results/planning_speed.json."""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--global-batch-size", type=int, default=2048, help="sequences per step (2048 x 4096 = 8M tokens)")
    args = ap.parse_args()
    from cost_models.model_profiler import profile_model
    from cost_models.models.source import resolve
    from cost_models.presets import preset
    from planner.request import PlanRequest
    from planner.search import plan

    t0 = time.perf_counter()
    prof = profile_model(resolve("llama3-70b"), micro_batch_size=1, seq_len=args.seq_len, meta=True, dtype="bf16")
    profile_s = time.perf_counter() - t0
    rows = []
    for nodes in (128, 2048):
        t0 = time.perf_counter()
        p = plan(prof, preset("dgx-h100", nodes=nodes), PlanRequest(gpus=8 * nodes, global_batch_size=args.global_batch_size))
        wall = time.perf_counter() - t0
        pv = p.provenance
        rows.append({"gpus": 8 * nodes, "wall_s": round(wall, 3), "considered": pv.points_considered,
                     "pruned": pv.points_pruned, "costed": pv.points_costed,
                     "chosen": p.rationale.summary.split(";")[0], "step_time_s": p.prediction.step_time_s})
    print(f"llama3-70b meta profile: {profile_s:.1f} s (not counted below); global batch {args.global_batch_size} x {args.seq_len}")
    print(f"{'GPUs':>6} {'wall s':>7} {'considered':>10} {'pruned':>7} {'costed':>7}  target  chosen")
    for r in rows:
        target = ("met" if r["wall_s"] <= 5 else "MISSED") if r["gpus"] == 1024 else "-"
        print(f"{r['gpus']:>6} {r['wall_s']:>7.2f} {r['considered']:>10} {r['pruned']:>7} {r['costed']:>7}  {target:<6}  {r['chosen']}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "planning_speed.json").write_text(json.dumps({
        "schema_version": 1, "kind": "zeropipe.benchmark.planning_speed", "rows": rows, "target_s_1024": 5.0,
        "global_batch_size": args.global_batch_size, "seq_len": args.seq_len,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}, indent=2) + "\n")


if __name__ == "__main__":
    main()
