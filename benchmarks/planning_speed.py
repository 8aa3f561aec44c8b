"""Planning speed: llama3-70b (meta profile) on dgx-h100 x 128 nodes (1,024 GPUs) and x 2,048 nodes (16,384 GPUs),
and llama3-405b on 16,384, with tensor parallelism in the space (tp 1, 2, 4, 8 with and without sequence
parallelism: ~4x the points); mixtures of experts with expert parallelism in the space: deepseek-v3 on 1,024 GPUs
and qwen3-30b-a3b on 128. Targets on this machine: <= 2 s for 70B at 1,024 GPUs, <= 10 s at 16,384 (both
models); the MoE rows within 2x the 70B row's target (issue: an MoE plan within 2x a dense 70B's planning time on
the same cluster), and their ratio to the 70B row's measured median is printed.

Each measurement is `plan()` cold, as a fresh `planner plan` runs it: a new process (imports and the profile's
loading not counted) plans once. The sizes are interleaved and repeated (--repeats), and each figure is printed as
median [min - max] with the machine's 1-minute load beside it (this machine is shared: +-15% minutes apart). Then,
per size, the points considered / pruned / costed, and where the search's time goes (the top functions of a
cProfile run), so the next step is obvious. Writes results/planning_speed.json."""
from __future__ import annotations

import argparse
import cProfile
import datetime as dt
import io
import json
import os
import pickle
import platform
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
# (model, nodes of 8 GPUs) -> the target in seconds
SIZES = {("llama3-70b", 128): 2.0, ("llama3-70b", 2048): 10.0, ("llama3-405b", 2048): 10.0,
         ("deepseek-v3", 128): 4.0, ("qwen3-30b-a3b", 16): 4.0}


def _request(nodes: int, args):
    from planner.request import PlanRequest
    kw = {"time_limit_s": args.time_limit} if args.time_limit is not None else {}   # else the planner's default
    return PlanRequest(gpus=8 * nodes, global_batch_size=args.global_batch_size, **kw)


def _cold(args) -> None:
    """One cold plan() in this (fresh) process; prints its figures as one JSON line."""
    from cost_models.records.presets import preset
    from planner.search import plan
    prof = pickle.loads(Path(args.cold_profile).read_bytes())
    cluster = preset("dgx-h100", nodes=args.cold)
    request = _request(args.cold, args)
    load = os.getloadavg()[0]
    model = prof.name
    c0, t0 = os.times(), time.perf_counter()
    p = plan(prof, cluster, request)
    wall, c1 = time.perf_counter() - t0, os.times()
    # CPU seconds of this process and its waited-for children (the MILP solver): on a shared machine, what the
    # plan costs less the time it waited for a core
    cpu = sum(getattr(c1, f) - getattr(c0, f) for f in ("user", "system", "children_user", "children_system"))
    pv = p.provenance
    print(json.dumps({"model": model, "gpus": 8 * args.cold, "wall_s": round(wall, 3), "cpu_s": round(cpu, 3),
                      "load_1min": round(load, 2),
                      "considered": pv.points_considered, "pruned": pv.points_pruned, "costed": pv.points_costed,
                      "milp_status": pv.milp_status, "chosen": p.strategy.name,
                      "step_time_s": p.prediction.step_time_s}))


def _top_functions(prof, nodes: int, args) -> list[str]:
    """plan()'s top functions by cumulative time (an in-process, profiled run: cProfile slows it ~2x)."""
    from cost_models.records.presets import preset
    from planner.search import plan
    profiler = cProfile.Profile()
    profiler.enable()
    plan(prof, preset("dgx-h100", nodes=nodes), _request(nodes, args))
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(r"(planner|cost_models)/", args.top)
    return [line.rstrip() for line in text.getvalue().splitlines() if "/" in line and "(" in line]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--global-batch-size", type=int, default=2048, help="sequences per step (2048 x 4096 = 8M tokens)")
    ap.add_argument("--time-limit", type=float, default=None, help="seconds for the MILP cross-check (default: the "
                    "planner's, as `planner plan` runs it)")
    ap.add_argument("--repeats", type=int, default=3, help="cold runs per size, interleaved")
    ap.add_argument("--top", type=int, default=12, help="functions of the profile to print (0: none)")
    ap.add_argument("--cold", type=int, help=argparse.SUPPRESS)          # internal: one cold run of this many nodes
    ap.add_argument("--cold-profile", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.cold:
        return _cold(args)
    from cost_models.models.source import resolve
    from cost_models.profiling.model_profiler import profile_model
    from planner.search import MILP_AUTO

    profiles, profile_s = {}, {}
    for model in sorted({m for m, _ in SIZES}):
        t0 = time.perf_counter()
        profiles[model] = profile_model(resolve(model), micro_batch_size=1, seq_len=args.seq_len, meta=True,
                                        dtype="bf16")
        profile_s[model] = time.perf_counter() - t0
    runs: dict[tuple[str, int], list[dict]] = {size: [] for size in SIZES}
    with tempfile.TemporaryDirectory() as tmp:
        paths = {m: Path(tmp) / f"{m}.pickle" for m in profiles}
        for m, path in paths.items():
            path.write_bytes(pickle.dumps(profiles[m]))
        extra = ["--time-limit", str(args.time_limit)] if args.time_limit is not None else []
        for _ in range(args.repeats):
            for model, nodes in SIZES:
                out = subprocess.run([sys.executable, __file__, "--cold", str(nodes), "--cold-profile",
                                      str(paths[model]), "--seq-len", str(args.seq_len), "--global-batch-size",
                                      str(args.global_batch_size), *extra],
                                     capture_output=True, text=True, check=True, cwd=ROOT)
                runs[model, nodes].append(json.loads(out.stdout.strip().splitlines()[-1]))
    milp = (f"{args.time_limit:g} s" if args.time_limit is not None else
            "the default: up to {:g} s on cuts of up to {} unit x stage binaries".format(*MILP_AUTO))
    print(f"meta profiles: {', '.join(f'{m} {s:.1f} s' for m, s in profile_s.items())} (not counted); global batch {args.global_batch_size} x "
          f"{args.seq_len}; MILP cross-check {milp}; {os.cpu_count()} CPUs; {args.repeats} cold runs per size, "
          f"interleaved, each in a fresh process")
    print(f"{'model':<12} {'GPUs':>6} {'wall s: median [min - max]':>27} {'CPU s':>6} {'load':>11} {'considered':>10} {'pruned':>7} "
          f"{'costed':>7}  target  chosen")
    rows = []
    for (model, nodes), target in SIZES.items():
        rs = runs[model, nodes]
        walls, loads = [r["wall_s"] for r in rs], [r["load_1min"] for r in rs]
        med, cpu = statistics.median(walls), statistics.median(r["cpu_s"] for r in rs)
        r0 = rs[0]
        row = {**{k: r0[k] for k in ("model", "gpus", "considered", "pruned", "costed", "milp_status", "chosen", "step_time_s")},
               "wall_s": walls, "wall_median_s": med, "cpu_median_s": cpu, "load_1min": loads,
               "target_s": target, "met": med <= target,
               "top_functions": _top_functions(profiles[model], nodes, args) if args.top else []}
        rows.append(row)
        spread = f"{med:.2f} [{min(walls):.2f} - {max(walls):.2f}]"
        print(f"{model:<12} {r0['gpus']:>6} {spread:>27} {cpu:>6.2f} {min(loads):>5.1f}-{max(loads):<5.1f} {r0['considered']:>10} "
              f"{r0['pruned']:>7} {r0['costed']:>7}  {'met' if row['met'] else 'MISSED':<6}  {r0['chosen']} "
              f"({r0['step_time_s']:.2f} s/step)")
        base = runs.get(("llama3-70b", 128))
        if model not in ("llama3-70b", "llama3-405b") and base:
            row["ratio_to_llama3_70b_1024"] = med / statistics.median(r["wall_s"] for r in base)
            print(f"       {row['ratio_to_llama3_70b_1024']:.2f}x llama3-70b's median on 1,024 GPUs")
        print(f"       MILP check: {r0['milp_status']}")
        for line in row["top_functions"]:
            print("       " + line)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "planning_speed.json").write_text(json.dumps({
        "schema_version": 4, "kind": "zeropipe.benchmark.planning_speed", "rows": rows,
        "global_batch_size": args.global_batch_size, "seq_len": args.seq_len, "milp_cross_check": milp,
        "repeats": args.repeats,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}, indent=2) + "\n")


if __name__ == "__main__":
    main()
