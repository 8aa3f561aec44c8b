"""Planning speed: llama3-70b (meta profile) on dgx-h100 x 128 nodes (1,024 GPUs) and x 2,048 nodes (16,384 GPUs),
with tensor parallelism in the space (tp 1, 2, 4, 8 with and without sequence parallelism: ~4x the points).
Targets on this machine: <= 2 s at 1,024 GPUs, <= 10 s at 16,384. Prints, per size, the wall time of `plan()`
(cold: as a fresh `planner plan` runs it), its search alone run again (warm: the schedules' action orders cached;
the rest of `plan()` is the winner's full estimate, the MILP cross-check of its stage cut and the rationale), the
points considered / pruned / costed, the machine's load, and where the search's time goes (the top functions of a
cProfile run), so the next step is obvious. Writes results/planning_speed.json."""
from __future__ import annotations

import argparse
import cProfile
import datetime as dt
import io
import json
import os
import platform
import pstats
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
TARGETS_S = {1024: 2.0, 16384: 10.0}


def _profile_search(prof, cluster, request, top: int) -> list[str]:
    """The search's top functions by cumulative time (a second, profiled run: cProfile slows it ~2x)."""
    from planner.search import search
    profiler = cProfile.Profile()
    profiler.enable()
    search(prof, cluster, request)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(r"(planner|cost_models)/", top)
    return [line.rstrip() for line in text.getvalue().splitlines() if "/" in line and "(" in line]


def _one(prof, nodes: int, args) -> dict:
    from cost_models.presets import preset
    from planner.request import PlanRequest
    from planner.search import plan, search
    cluster = preset("dgx-h100", nodes=nodes)
    request = PlanRequest(gpus=8 * nodes, global_batch_size=args.global_batch_size, time_limit_s=args.time_limit)
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    p = plan(prof, cluster, request)          # first: cold caches (schedule orders), as a fresh `planner plan`
    wall = time.perf_counter() - t0
    t0 = time.perf_counter()
    found = search(prof, cluster, request)    # again, warm: the search alone
    search_s = time.perf_counter() - t0
    pv = p.provenance
    by_tp: dict[int, int] = {}
    for c in found.feasible + found.infeasible:
        by_tp[c.strategy.tp] = by_tp.get(c.strategy.tp, 0) + 1
    return {"gpus": 8 * nodes, "wall_s": round(wall, 3), "search_s": round(search_s, 3),
            "load_1min": round(load, 2), "considered": pv.points_considered, "pruned": pv.points_pruned,
            "costed": pv.points_costed, "costed_by_tp": by_tp, "milp_status": pv.milp_status,
            "chosen": p.strategy.name, "step_time_s": p.prediction.step_time_s,
            "top_functions": _profile_search(prof, cluster, request, args.top) if args.top else []}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--global-batch-size", type=int, default=2048, help="sequences per step (2048 x 4096 = 8M tokens)")
    ap.add_argument("--time-limit", type=float, default=2.0, help="seconds for the MILP cross-check (planner's "
                    "--time-limit)")
    ap.add_argument("--top", type=int, default=12, help="functions of the search's profile to print (0: none)")
    args = ap.parse_args()
    from cost_models.model_profiler import profile_model
    from cost_models.models.source import resolve

    t0 = time.perf_counter()
    prof = profile_model(resolve("llama3-70b"), micro_batch_size=1, seq_len=args.seq_len, meta=True, dtype="bf16")
    profile_s = time.perf_counter() - t0
    rows = [_one(prof, nodes, args) for nodes in (128, 2048)]
    print(f"llama3-70b meta profile: {profile_s:.1f} s (not counted below); global batch {args.global_batch_size} x "
          f"{args.seq_len}; {os.cpu_count()} CPUs; wall = plan() cold, search = the search alone, warm")
    print(f"{'GPUs':>6} {'wall s':>7} {'search s':>8} {'load':>5} {'considered':>10} {'pruned':>7} {'costed':>7}  "
          f"target  chosen")
    for r in rows:
        target = "met" if r["wall_s"] <= TARGETS_S[r["gpus"]] else "MISSED"
        print(f"{r['gpus']:>6} {r['wall_s']:>7.2f} {r['search_s']:>8.2f} {r['load_1min']:>5.1f} {r['considered']:>10} "
              f"{r['pruned']:>7} {r['costed']:>7}  {target:<6}  {r['chosen']} ({r['step_time_s']:.2f} s/step)")
        print(f"       costed per tp: {r['costed_by_tp']}; MILP check: {r['milp_status']}")
        for line in r["top_functions"]:
            print("       " + line)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "planning_speed.json").write_text(json.dumps({
        "schema_version": 2, "kind": "zeropipe.benchmark.planning_speed", "rows": rows, "targets_s": TARGETS_S,
        "global_batch_size": args.global_batch_size, "seq_len": args.seq_len, "milp_time_limit_s": args.time_limit,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}, indent=2) + "\n")


if __name__ == "__main__":
    main()
