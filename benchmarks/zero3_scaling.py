"""ZeRO-3 at a fixed global batch as the GPU count doubles: what the cost model predicts per GPU.

Strong scaling: the global batch stays (default 1,024 sequences of 4,096 tokens, llama3-8b meta profile, bf16-mixed,
dgx-h100 nodes), so each doubling halves the local batch while a rank's parameter gathers and gradient
reduce-scatters per micro-batch stay the same bytes and their ring latency grows with the ranks
(cost_models/cost/comm.py: NCCL's per-step latency, src/graph/tuning.cc). For each GPU count the fastest fitting ZeRO-3
data-parallel strategy (pp = 1, tp = 1) over micro-batch sizes and recompute is kept, as the planner would among ZeRO-3
plans. Prints a table (GPUs, local batch, micro-batches, predicted step time, per-GPU tokens/s, exposed data-parallel
comm, MFU and HFU) and writes benchmarks/results/zero3_scaling.json. Predictions only: nothing here is measured; the
collectives' bus bandwidth at scale is checked against published nccl-tests figures (cost_models/records/presets.py,
tests/test_comm.py: all-gather on 32 DGX H100 nodes predicted 179 GB/s, ~200 published in NVIDIA/nccl#1218).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
sys.path.insert(0, str(RESULTS.parents[1]))
from cost_models.cost.estimate import estimate  # noqa: E402  (after the path: the script runs from a checkout)
from cost_models.records.formatting import duration  # noqa: E402
from cost_models.records.presets import preset  # noqa: E402
from cost_models.records.strategy import Strategy  # noqa: E402


def best_zero3(prof, cluster, gpus: int, global_batch: int):
    """The fastest fitting ZeRO-3 (dp = gpus) strategy over micro-batch sizes and full recompute: (strategy, est)."""
    names = tuple(u.name for u in prof.units)
    local = global_batch // gpus
    best = None
    mbs = 1
    while mbs <= local:
        if local % mbs == 0:
            for rec in (None, (True,)):
                s = Strategy(dp=gpus, pp=1, zero=3, schedule="1f1b", microbatches=local // mbs, micro_batch_size=mbs,
                             stages=(names,), precision="bf16-mixed", optimizer="adamw", recompute=rec)
                est = estimate(s, prof, cluster, compact=True)
                if est.fits and (best is None or est.step_time_s < best[1].step_time_s):
                    best = (s, est)
        mbs *= 2
    return best


def _row(gpus: int, local: int, s, est, first: float | None) -> tuple[dict, str]:
    """One table row: its JSON record and its printed line."""
    per_gpu = est.tokens_per_s / gpus
    row = {"gpus": gpus, "local_batch": local, "micro_batch_size": s.micro_batch_size,
           "microbatches": s.microbatches, "recompute": bool(s.recompute), "step_time_s": est.step_time_s,
           "tokens_per_s_per_gpu": per_gpu, "compute_s": est.breakdown.compute_s,
           "exposed_dp_comm_s": est.breakdown.dp_comm_s, "mfu": est.mfu, "hfu": est.hfu}
    rel = per_gpu / (first or per_gpu)
    line = (f"{gpus:>6} {local:>6} {f'{s.micro_batch_size} x {s.microbatches}':>9} "
            f"{'full' if s.recompute else 'none':>9} {duration(est.step_time_s):>9} {per_gpu:>10,.0f} {rel:>8.2f} "
            f"{duration(est.breakdown.dp_comm_s):>12} {est.mfu:>6.1%} {est.hfu:>6.1%}")
    return row, line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--cluster", default="dgx-h100")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--global-batch-size", type=int, default=1024, help="sequences per step")
    ap.add_argument("--max-gpus", type=int, default=1024)
    args = ap.parse_args()
    from cost_models.models.source import resolve
    from cost_models.profiling.model_profiler import profile_model
    prof = profile_model(resolve(args.model), micro_batch_size=1, seq_len=args.seq_len, meta=True, dtype="bf16")
    base = preset(args.cluster)
    rows: list[dict] = []
    lines = [f"ZeRO-3, {args.model} (meta profile), global batch {args.global_batch_size} x {args.seq_len} tokens, "
             f"{args.cluster} nodes of {base.devices_per_node}; predicted, not measured", "",
             f"{'GPUs':>6} {'local':>6} {'mbs x m':>9} {'recompute':>9} {'step':>9} {'tok/s/GPU':>10} {'vs first':>8} "
             f"{'exposed comm':>12} {'MFU':>6} {'HFU':>6}"]
    gpus = base.devices_per_node
    while gpus <= min(args.max_gpus, args.global_batch_size):
        cluster = preset(args.cluster, nodes=max(1, gpus // base.devices_per_node))
        found = best_zero3(prof, cluster, gpus, args.global_batch_size)
        if found is None:
            lines.append(f"{gpus:>6}  nothing fits")
        else:
            row, line = _row(gpus, args.global_batch_size // gpus, *found,
                             rows[0]["tokens_per_s_per_gpu"] if rows else None)
            rows.append(row)
            lines.append(line)
        gpus *= 2
    lines += ["", "MFU: model FLOPs (PaLM convention, no recompute); HFU: hardware FLOPs (with recompute and torch's "
              "attention backward); exposed comm: data-parallel collectives not hidden behind compute."]
    print("\n".join(lines))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "zero3_scaling.md").write_text("# ZeRO-3 strong scaling (predicted)\n\n```\n" + "\n".join(lines)
                                              + "\n```\n\nWritten by `python benchmarks/zero3_scaling.py`.\n")
    (RESULTS / "zero3_scaling.json").write_text(json.dumps({
        "schema_version": 1, "kind": "zeropipe.benchmark.zero3_scaling", "model": args.model,
        "cluster": args.cluster, "seq_len": args.seq_len, "global_batch_size": args.global_batch_size,
        "rows": rows, "predicted_only": True,
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}, indent=2) + "\n")


if __name__ == "__main__":
    main()
