"""How late a gloo send reaches its peer when the sender goes on computing (torch.distributed alone, no zeropipe code
in the ranks): what the estimate's pipeline simulation assumes about messages on CPU ranks (simulator._evaluate,
SEND_DELAY_CAP_S).

    python benchmarks/send_delay.py              # ~1 min here
    python benchmarks/send_delay.py --repeats 20

Rank 1 posts isend of a 16 KB tensor (a stage's activation or gradient), computes for d ms (256 x 256 matmuls),
then waits on the send; rank 0 waits on the matching irecv. The delay is when rank 0's wait returned, less when
rank 1 posted the send (perf_counter is CLOCK_MONOTONIC, one clock for every process). With 4 ranks, ranks 2 and 3
compute meanwhile, so the 4 processes share the machine's cores as a 4-rank plan's do. If a send only left when its
sender next waits, the delay would grow with d; if it left at once, it would stay at the transfer's latency.
Values of d are interleaved and repeated; medians with [min - max] and the machine's 1-minute load are printed.
JSON: benchmarks/results/send_delay.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from pipeline_overlap import _free_port  # this script's folder is on sys.path: run as a script

ROOT = Path(__file__).resolve().parents[1]
COMPUTE_MS = (1, 2, 4, 8, 16, 32)
MESSAGE_BYTES = 16384
WARMUP = 2


def _busy(seconds: float) -> None:
    a = torch.randn(256, 256)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ a


def _rank(rank: int, world: int, port: int, repeats: int, out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        message = torch.zeros(MESSAGE_BYTES // 4)
        delays: dict[int, list[float]] = {ms: [] for ms in COMPUTE_MS}
        for rep in range(WARMUP + repeats):
            for ms in COMPUTE_MS:   # interleaved: each repeat walks every d
                dist.barrier()
                if rank >= 2:
                    _busy(ms * 1.2e-3)
                elif rank == 1:
                    posted = torch.tensor([time.perf_counter()], dtype=torch.float64)
                    work = dist.isend(message, 0)
                    _busy(ms * 1e-3)
                    work.wait()
                    dist.send(posted, 0)
                else:
                    work = dist.irecv(message, 1)
                    work.wait()
                    arrived = time.perf_counter()
                    posted = torch.zeros(1, dtype=torch.float64)
                    dist.recv(posted, 1)
                    if rep >= WARMUP:
                        delays[ms].append(arrived - posted.item())
        if rank == 0:
            out.put(delays)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def measure(world: int, repeats: int) -> dict[int, list[float]]:
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    mp.spawn(_rank, args=(world, _free_port(), repeats, q), nprocs=world)
    return q.get()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=12)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args(argv)
    rows, loads = [], []
    print(f"{'ranks':>5} {'sender computes':>16} {'delay, median [min - max]':>30} {'load':>5}")
    for world in (2, 4):
        loads.append(os.getloadavg()[0])
        delays = measure(world, args.repeats)
        loads.append(os.getloadavg()[0])
        for ms in COMPUTE_MS:
            d = delays[ms]
            row = {"ranks": world, "compute_s": ms * 1e-3, "median_s": statistics.median(d), "min_s": min(d),
                   "max_s": max(d), "samples": len(d), "load_1min": loads[-1]}
            rows.append(row)
            print(f"{world:>5} {ms:>13} ms {row['median_s'] * 1e3:>10.2f} ms [{row['min_s'] * 1e3:.2f} - "
                  f"{row['max_s'] * 1e3:.2f}] {loads[-1]:>5.1f}")
    print(f"machine load (1-minute) during the runs: {min(loads):.1f} to {max(loads):.1f} on {os.cpu_count()} CPUs")
    data = {"schema_version": 1, "kind": "zeropipe.benchmark.send_delay", "message_bytes": MESSAGE_BYTES,
            "repeats": args.repeats, "rows": rows, "load_1min": [min(loads), max(loads)],
            "machine": f"{os.cpu_count()} CPUs, {platform.platform()}, Python {platform.python_version()}, "
                       f"torch {torch.__version__}"}
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = args.out / "send_delay.json.tmp"
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(args.out / "send_delay.json")
    print(f"wrote {args.out / 'send_delay.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
