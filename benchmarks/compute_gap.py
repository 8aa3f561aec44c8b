"""Where the predicted compute and the executor's measured compute part (issue 18, item 4): the same model, micro-batch
and thread count timed four ways, interleaved and repeated, so each step from the profile to the run is one ratio.

    python benchmarks/compute_gap.py                 # gpt-wide, mlp-deep; ~3 min here
    python benchmarks/compute_gap.py --models gpt-wide --repeats 3

A  profile:    `planner profile`'s per-unit medians (each unit alone on its captured input, 1 thread), summed:
               what the estimate's compute is built from.
B  in model:   one process, 1 thread, the whole model's forward, loss and backward, timed end to end, and per unit
               by module hooks (forward pre/post, full backward pre/post).
C  two at once: B in two processes started together (two CPU ranks on this machine's cores, no collectives).
D1 executor:   D on one rank (dp=1: no DDP, no collectives): the executor's own cost beside B.
D  executor:   `run_many` on 2 gloo ranks, ZeRO-0 dp=2, one micro-batch per step: the run's compute_s (time inside
               forward/backward, DDP's bucket all-reduce included), per micro-batch.
E  estimate:   the estimate's compute_s for that plan on this machine's probed cluster (probe_local, 2 ranks): A times
               the probe's contention factor for 2 ranks (cost_models.cost.sharing.contention); "E + all-reduce" adds
               the estimate's exposed data-parallel time (DDP's all-reduce, which D's compute_s contains).
The table prints the medians with [min - max] over repeats and the machine's 1-minute load beside them; JSON goes to
benchmarks/results/compute_gap.json.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SEQ_LEN, BATCH = 32, 4          # as benchmarks/fidelity.py profiles


def _in_model(model_name: str, iters: int, barrier=None) -> dict:
    """B: forward + loss + backward of the whole model, 1 thread; per-unit seconds from module hooks (medians)."""
    import torch

    from cost_models.models.losses import compute_loss, synthetic_target
    from cost_models.models.source import resolve
    from cost_models.profiling.model_profiler import profile_model  # noqa: F401  (same import cost as the other paths)
    from executor.runtime import logits_of
    torch.set_num_threads(1)
    source = resolve(model_name)
    model = source.build(device=None, dtype=torch.float32, seed=0)
    x = source.example_input(model, BATCH, SEQ_LEN, "cpu")[0]
    loss_kind = "cross_entropy" if not x.is_floating_point() else "mse"
    units = _unit_modules(model)
    marks: dict[str, list[float]] = {}
    for name, module in units:
        module.register_forward_pre_hook(lambda m, a, n=name: marks.setdefault(n + ":f0", []).append(time.perf_counter()))
        module.register_forward_hook(lambda m, a, o, n=name: marks.setdefault(n + ":f1", []).append(time.perf_counter()))
        module.register_full_backward_pre_hook(lambda m, g, n=name: marks.setdefault(n + ":b0", []).append(time.perf_counter()))
        module.register_full_backward_hook(lambda m, gi, go, n=name: marks.setdefault(n + ":b1", []).append(time.perf_counter()))
    with torch.no_grad():
        target = synthetic_target(loss_kind, logits_of(model(x)))
    marks.clear()
    if barrier is not None:
        barrier.wait()
    totals = []
    for _ in range(iters):
        t0 = time.perf_counter()
        loss = compute_loss(loss_kind, logits_of(model(x)), target)
        loss.backward()
        totals.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    warm = 2
    per_unit = {}
    for name, _ in units:
        f = [b - a for a, b in zip(marks.get(name + ":f0", []), marks.get(name + ":f1", []))][warm:]
        bw = [b - a for a, b in zip(marks.get(name + ":b0", []), marks.get(name + ":b1", []))][warm:]
        per_unit[name] = (statistics.median(f) if f else 0.0, statistics.median(bw) if bw else 0.0)
    return {"total_s": statistics.median(totals[warm:]), "units": per_unit}


def _unit_modules(model) -> list:
    """(name, module) of the profile's units: the model's leaf-level children that hold parameters, one level into
    containers (blocks.0, blocks.1, ...), as the profiler splits the zoo's models."""
    import torch.nn as nn
    out = []
    for name, child in model.named_children():
        if isinstance(child, (nn.ModuleList, nn.Sequential)):
            out += [(f"{name}.{i}", m) for i, m in enumerate(child)]
        else:
            out.append((name, child))
    return out


def _worker(model_name: str, iters: int, barrier, queue) -> None:
    queue.put(_in_model(model_name, iters, barrier))


def _two_at_once(model_name: str, iters: int) -> list[dict]:
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(model_name, iters, barrier, queue)) for _ in range(2)]
    for p in procs:
        p.start()
    out = [queue.get() for _ in procs]
    for p in procs:
        p.join()
    return out


def _profile(model_name: str) -> dict:
    from cost_models.models.source import resolve
    from cost_models.profiling.model_profiler import profile_model
    prof = profile_model(resolve(model_name), micro_batch_size=BATCH, seq_len=SEQ_LEN, dtype="fp32", threads=1,
                         repeats=5, warmup=2)
    units = {u.name: (u.fwd_time.median_s, u.bwd_time.median_s) for u in prof.units}
    return {"total_s": sum(f + b for f, b in units.values()), "units": units, "profile": prof}


def _executor(model_name: str, prof, steps: int, ranks: int = 2) -> float:
    from cost_models.records.strategy import Strategy
    from executor.launch import run_many
    from executor.train import TrainConfig
    s = Strategy(dp=ranks, pp=1, zero=0, schedule="1f1b", microbatches=1, micro_batch_size=BATCH,
                 stages=(tuple(u.name for u in prof.units),), precision="fp32", optimizer="adamw")
    cfg = TrainConfig(model_source=model_name, seq_len=SEQ_LEN, input_kind=prof.input.kind, steps=steps, warmup=2,
                      count_comm=False)
    return max(statistics.median(r.compute_s[2:]) for r in run_many(ranks, [s], cfg)[0])


def _estimate(prof, cluster) -> tuple[float, float]:
    from cost_models.cost.estimate import estimate
    from cost_models.records.strategy import Strategy
    s = Strategy(dp=2, pp=1, zero=0, schedule="1f1b", microbatches=1, micro_batch_size=BATCH,
                 stages=(tuple(u.name for u in prof.units),), precision="fp32", optimizer="adamw")
    b = estimate(s, prof, cluster).breakdown
    return b.compute_s, b.dp_comm_s


def _spread(values: list[float]) -> dict:
    return {"median_s": statistics.median(values), "min_s": min(values), "max_s": max(values)}


def measure(model_name: str, repeats: int, iters: int) -> dict:
    rows: dict[str, list[float]] = {"A profile": [], "B in model": [], "B unit sum": [], "C two at once": [],
                                    "D1 executor 1 rank": [], "D executor": [], "E estimate": [],
                                    "E + all-reduce": []}
    from cost_models.profiling.cluster_source import probe_local
    loads = []
    units_a = units_b = None
    for _ in range(repeats):        # the four interleaved, so a load change hits them all
        loads.append(os.getloadavg()[0])
        a = _profile(model_name)
        rows["A profile"].append(a["total_s"])
        units_a = a["units"]
        b = _in_model(model_name, iters)
        rows["B in model"].append(b["total_s"])
        rows["B unit sum"].append(sum(f + bw for f, bw in b["units"].values()))
        units_b = b["units"]
        rows["C two at once"].append(max(r["total_s"] for r in _two_at_once(model_name, iters)))
        rows["D1 executor 1 rank"].append(_executor(model_name, a["profile"], steps=iters, ranks=1))
        rows["D executor"].append(_executor(model_name, a["profile"], steps=iters))
        compute, dp_comm = _estimate(a["profile"], probe_local(ranks=2, dtype="fp32", sizes=None))
        rows["E estimate"].append(compute)
        rows["E + all-reduce"].append(compute + dp_comm)
    loads.append(os.getloadavg()[0])
    return {"model": model_name, "micro_batch_size": BATCH, "seq_len": SEQ_LEN,
            "rows": {k: _spread(v) for k, v in rows.items()}, "load_1min": [min(loads), max(loads)],
            "units": {n: {"profile": units_a.get(n), "in_model": units_b.get(n)} for n in units_a}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="gpt-wide,mlp-deep")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--iters", type=int, default=8, help="forward+backward runs per measurement (2 are warm-up)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "compute_gap.json"))
    args = ap.parse_args()
    results = [measure(m, args.repeats, args.iters) for m in args.models.split(",")]
    print(f"{'model':10} {'way':18} {'median':>9} {'[min - max]':>21} {'/ A':>6}   load")
    for r in results:
        base = r["rows"]["A profile"]["median_s"]
        for way, t in r["rows"].items():
            print(f"{r['model']:10} {way:18} {t['median_s'] * 1e3:8.2f}ms [{t['min_s'] * 1e3:7.2f} - "
                  f"{t['max_s'] * 1e3:7.2f} ms] {t['median_s'] / base:6.2f}   {r['load_1min'][0]:.1f}-"
                  f"{r['load_1min'][1]:.1f}")
    out = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform()}, "results": results}
    Path(args.out).write_text(json.dumps(out, indent=1, default=str))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
