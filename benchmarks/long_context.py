"""Long sequences: planning with context parallelism in the space. llama3-8b at 131,072 tokens per sequence on
dgx-h100 x 4 nodes (32 GPUs; the plan must fit with cp > 1 and say why) and llama3-405b at 131,072 on x 2,048
nodes (16,384 GPUs; target: plan within 10 s). Each plan is run cold in a fresh process, repeated (--repeats),
interleaved, and printed as median [min - max] with the machine's 1-minute load beside it; per row the points
considered / pruned / costed and the context-parallel degrees searched. Writes results/long_context.json."""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import pickle
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SEQ = 131_072
# (model, nodes of 8 GPUs, global batch in sequences) -> planning-time target in seconds (None: none stated)
SIZES = {("llama3-8b", 4, 32): None, ("llama3-405b", 2048, 256): 10.0}


def _cold(args) -> None:
    """One cold plan() in this (fresh) process; prints its figures as one JSON line."""
    from cost_models.records.presets import preset
    from planner.request import PlanRequest
    from planner.search import plan
    prof = pickle.loads(Path(args.cold_profile).read_bytes())
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    p = plan(prof, preset("dgx-h100", nodes=args.cold), PlanRequest(global_batch_size=args.batch))
    wall = time.perf_counter() - t0
    pv, s = p.provenance, p.strategy
    print(json.dumps({"model": prof.name, "gpus": 8 * args.cold, "wall_s": round(wall, 3), "load_1min": round(load, 2),
                      "considered": pv.points_considered, "pruned": pv.points_pruned, "costed": pv.points_costed,
                      "chosen": s.name, "cp": s.cp, "fits": p.prediction.fits,
                      "step_time_s": p.prediction.step_time_s,
                      "peak_gib": p.prediction.peak_memory_bytes / 2**30,
                      "cp_lines": [line for line in p.rationale.lines if "cp=" in line or "context" in line]}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2, help="cold runs per size, interleaved")
    ap.add_argument("--cold", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--cold-profile", help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.cold:
        return _cold(args)
    from cost_models.models.source import resolve
    from cost_models.profiling.model_profiler import profile_model
    runs: dict[tuple, list[dict]] = {size: [] for size in SIZES}
    with tempfile.TemporaryDirectory() as tmp:
        paths = {}
        for model in sorted({m for m, _, _ in SIZES}):
            prof = profile_model(resolve(model), micro_batch_size=1, seq_len=SEQ, meta=True, dtype="bf16")
            paths[model] = Path(tmp) / f"{model}.pickle"
            paths[model].write_bytes(pickle.dumps(prof))
        for _ in range(args.repeats):
            for model, nodes, batch in SIZES:
                out = subprocess.run([sys.executable, __file__, "--cold", str(nodes), "--cold-profile",
                                      str(paths[model]), "--batch", str(batch)],
                                     capture_output=True, text=True, check=True, cwd=ROOT)
                runs[model, nodes, batch].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"{SEQ:,} tokens per sequence; {args.repeats} cold runs per size, interleaved, each in a fresh process; "
          f"{os.cpu_count()} CPUs")
    rows = []
    for (model, nodes, batch), target in SIZES.items():
        rs = runs[model, nodes, batch]
        walls, loads = [r["wall_s"] for r in rs], [r["load_1min"] for r in rs]
        med = statistics.median(walls)
        r0 = rs[0]
        row = {**{k: v for k, v in r0.items() if k not in ("wall_s", "load_1min")}, "global_batch_size": batch,
               "wall_s": walls, "wall_median_s": med, "load_1min": loads, "target_s": target,
               "met": None if target is None else med <= target}
        rows.append(row)
        print(f"{model} on {r0['gpus']:,} GPUs, B={batch}: {med:.2f} s [{min(walls):.2f} - {max(walls):.2f}] "
              f"(load {min(loads):.1f}-{max(loads):.1f}; target {target if target else '-'} s: "
              f"{'-' if target is None else 'met' if row['met'] else 'MISSED'}); {r0['considered']} points, "
              f"{r0['pruned']} pruned, {r0['costed']} estimates; chosen {r0['chosen']} ({r0['step_time_s']:.1f} "
              f"s/step, peak {r0['peak_gib']:.1f} GiB, fits {r0['fits']})")
        for line in r0["cp_lines"]:
            print("    " + line)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "long_context.json").write_text(json.dumps({
        "schema_version": 1, "kind": "zeropipe.benchmark.long_context", "seq_len": SEQ, "rows": rows,
        "repeats": args.repeats,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}, indent=2) + "\n")


if __name__ == "__main__":
    main()
