"""Where a pipeline step's time goes on CPU ranks, with torch.distributed.pipelining alone (no zeropipe code runs in
the ranks): two gloo ranks, one stage each (a stack of Linear layers), GPipe and 1F1B, a few stage sizes.

    python benchmarks/pipeline_overlap.py              # ~1 min here
    python benchmarks/pipeline_overlap.py --repeats 5

Per configuration and rank: the stage's plain forward + backward on one micro-batch (timed alone), the time inside
the schedule's forward_one_chunk / backward_one_chunk (what zeropipe's executor reports as compute), the step's wall
time and the process's CPU time over the step. From them:
  ideal      (M + 1) x one micro-batch's forward + backward: a 2-stage pipeline with free messages and no overhead
  overhead   (CPU time - time inside the stage calls) / actions: what the schedule runtime and gloo cost per action
  idle       wall - CPU time: waiting on the peer
Configurations are interleaved and repeated; medians with [min - max] and the machine's 1-minute load are printed.
JSON: benchmarks/results/pipeline_overlap.json. Fidelity (README) cites it for what the estimate's pipeline misses.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
STEPS, WARMUP = 10, 4
# (width, layers, micro-batch size, micro-batches): from a stage far cheaper than its messages' handling to one
# whose micro-batch takes a few ms
CONFIGS = ((256, 4, 1, 8), (512, 4, 4, 8), (1024, 2, 8, 4))
SCHEDULES = ("ScheduleGPipe", "Schedule1F1B")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _timed(fn, acc: list[float]):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[0] += time.perf_counter() - t0
    return wrapper


def _rank(rank: int, port: int, schedule: str, cfg: tuple[int, int, int, int], out) -> None:
    from torch.distributed import pipelining
    torch.set_num_threads(1)
    width, layers, mbs, m = cfg
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        stage_mod = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
        x = torch.randn(m * mbs, width)
        one = x[:mbs].clone().requires_grad_(rank > 0)

        def plain() -> None:
            y = stage_mod(one)
            (F.mse_loss(y, torch.zeros_like(y)) if rank == 1 else y.sum()).backward()
        for _ in range(WARMUP):
            plain()
        t0 = time.perf_counter()
        for _ in range(STEPS):
            plain()
        plain_s = (time.perf_counter() - t0) / STEPS
        stage = pipelining.PipelineStage(stage_mod, rank, 2, torch.device("cpu"),
                                         input_args=(torch.empty(mbs, width, requires_grad=rank > 0),),
                                         output_args=(torch.empty(mbs, width, requires_grad=True),))
        inside = [0.0]
        for name in ("forward_one_chunk", "backward_one_chunk"):
            setattr(stage, name, _timed(getattr(stage, name), inside))
        sched = getattr(pipelining.schedules, schedule)(stage, n_microbatches=m, loss_fn=lambda o, y: F.mse_loss(o, y))

        def step() -> None:
            if rank == 0:
                sched.step(x)
            else:
                sched.step(target=torch.zeros(m * mbs, width))
        for _ in range(WARMUP):
            dist.barrier()
            step()
        dist.barrier()
        inside[0] = 0.0
        c0, t0 = time.process_time(), time.perf_counter()
        for _ in range(STEPS):
            step()
        wall, cpu = (time.perf_counter() - t0) / STEPS, (time.process_time() - c0) / STEPS
        row = {"rank": rank, "plain_s": plain_s, "inside_s": inside[0] / STEPS, "wall_s": wall, "cpu_s": cpu}
        rows = [None, None]
        dist.all_gather_object(rows, row)
        if rank == 0:
            out.put(rows)
    finally:
        dist.destroy_process_group()


def measure(schedule: str, cfg: tuple[int, int, int, int]) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, schedule, cfg, queue)) for r in range(2)]
    for p in procs:
        p.start()
    rows = queue.get(timeout=300)
    for p in procs:
        p.join()
    m = cfg[3]
    actions = 2 * m
    slow = max(rows, key=lambda r: r["wall_s"])
    return {"wall_s": slow["wall_s"], "ideal_s": (m + 1) * max(r["plain_s"] for r in rows),
            "inside_s": max(r["inside_s"] for r in rows), "plain_step_s": m * max(r["plain_s"] for r in rows),
            "overhead_per_action_s": max((r["cpu_s"] - r["inside_s"]) / actions for r in rows),
            "idle_s": max(r["wall_s"] - r["cpu_s"] for r in rows), "ranks": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {}
    loads = []
    for _ in range(args.repeats):          # interleaved: every configuration once per round
        for schedule in SCHEDULES:
            for cfg in CONFIGS:
                key = f"{schedule} w{cfg[0]} x{cfg[1]} mbs{cfg[2]} m{cfg[3]}"
                runs.setdefault(key, []).append(measure(schedule, cfg))
                loads.append(os.getloadavg()[0])
    med = lambda rs, k: statistics.median(r[k] for r in rs)   # noqa: E731
    spread = lambda rs, k: f"[{min(r[k] for r in rs) * 1e3:.1f}-{max(r[k] for r in rs) * 1e3:.1f}]"   # noqa: E731
    print(f"{'configuration':<36} {'step ms':>18} {'ideal':>6} {'/ideal':>6} {'in stage':>8} "
          f"{'overhead/action':>15} {'idle':>6}")
    summary = {}
    for key, rs in runs.items():
        summary[key] = {k: med(rs, k) for k in ("wall_s", "ideal_s", "inside_s", "plain_step_s",
                                                 "overhead_per_action_s", "idle_s")}
        s = summary[key]
        print(f"{key:<36} {s['wall_s'] * 1e3:7.1f} {spread(rs, 'wall_s'):>10} {s['ideal_s'] * 1e3:6.1f} "
              f"{s['wall_s'] / s['ideal_s']:6.2f} {s['inside_s'] * 1e3:8.1f} {s['overhead_per_action_s'] * 1e3:12.2f} ms "
              f"{s['idle_s'] * 1e3:6.1f}")
    print(f"machine load (1-minute) during the runs: {min(loads):.1f} to {max(loads):.1f} on {os.cpu_count()} CPUs")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = {"schema_version": 1, "kind": "zeropipe.benchmark.pipeline_overlap", "repeats": args.repeats,
            "steps": STEPS, "warmup": WARMUP, "summary": summary, "runs": runs, "load_1min": [min(loads), max(loads)],
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__}}
    tmp = out / "pipeline_overlap.json.tmp"
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(out / "pipeline_overlap.json")
    print(f"wrote {out / 'pipeline_overlap.json'}")


if __name__ == "__main__":
    sys.exit(main())
