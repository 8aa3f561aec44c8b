"""`planner demo`: the main job end to end on a built-in default, on this machine.

Profile the model (real mode, gpt-tiny) and this machine (4 CPU ranks over gloo, GPUs or not), plan for those 4 ranks (every ZeRO stage,
pipeline depth, schedule and micro-batching, with the rationale), then run the plan for a few steps with real
torch.distributed code, compare predicted with measured, and write the report (HTML and Markdown) with both.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from cost_models.models.source import resolve
from cost_models.profiling.cluster_source import StatusFn, probe_local
from cost_models.profiling.model_profiler import SETTLE_S, ProgressFn, profile_model
from cost_models.records.fileio import write_atomic
from cost_models.records.files import ProfileFile
from executor.launch import WARMUP_STEPS, RunConfig, launch
from planner.plan import Plan
from planner.report import render_html, render_markdown
from planner.request import PlanRequest
from planner.run_record import RunFile
from planner.search import plan

DEMO_MODEL = "gpt-tiny"
DEMO_SEQ_LEN = 64
DEMO_RANKS = 4
DEMO_GLOBAL_BATCH = 64    # sequences per step
# The profile's micro-batch: each rank's share of the batch under data parallelism over every rank, the plan a
# quiet machine picks. A unit is timed at this size and at one sample, and the estimate interpolates between
# them, so that plan is priced at its own size; from a smaller profile its time was extrapolated past the timings,
# which missed how per-sample work grows with the working set (benchmarks/results/measurements.md, "The demo's
# profile micro-batch").
DEMO_MICRO_BATCH = DEMO_GLOBAL_BATCH // DEMO_RANKS
# 8 timed steps after WARMUP_STEPS: the measured step is their median, and on a shared machine single steps stray
# by a scheduler's slices (a median of 4 moved with one or two slow steps: benchmarks/results/measurements.md,
# "The demo under two busy loops")
DEMO_STEPS = 10


@dataclass(frozen=True)
class DemoResult:
    profile_path: Path
    plan_path: Path
    plan: Plan
    run_path: Path
    run: RunFile
    report_path: Path


def _cpu_ranks_only() -> int:
    """Hide the GPUs from this process and the ranks it starts; returns how many NVML saw (0 without a driver).
    The demo's 4 ranks need none, and a machine with fewer than 4 GPUs could not host them as GPU ranks (seen on a
    one-GPU H200: the probe's rank 1 failed, 'invalid device ordinal'). torch reads CUDA_VISIBLE_DEVICES once, at
    its first CUDA call, which the demo has not made yet."""
    from cost_models.profiling.nvml_topology import detect_topology
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    topology, _ = detect_topology()
    return len(topology.gpus) if topology else 0


def run_demo(out_dir: Path, *, command: str = "", on_progress: ProgressFn | None = None,
             on_status: StatusFn | None = None) -> DemoResult:
    """Profile the demo model (one thread, as each rank runs) and this machine, then plan; files in out_dir
    (the demo's own, rewritten on every run)."""
    gpus = _cpu_ranks_only()
    if gpus and on_status:
        on_status(f"the demo runs {DEMO_RANKS} CPU ranks (gloo) and leaves this machine's {gpus} GPU(s) alone; "
                  f"planner profile / plan / run use them")
    # executor ranks run one thread each: measure the units the way they will run
    prof = profile_model(resolve(DEMO_MODEL), micro_batch_size=DEMO_MICRO_BATCH, seq_len=DEMO_SEQ_LEN, dtype="fp32",
                         device="cpu", threads=1, command=command, on_progress=on_progress, settle_s=SETTLE_S)
    cluster = probe_local(ranks=DEMO_RANKS, dtype="fp32", sizes=None, on_status=on_status, gpus=False)
    profile_path = out_dir / "profile.json"
    ProfileFile(model=prof, cluster=cluster).save(profile_path, overwrite=True)
    if on_status:
        on_status("planning")
    result = plan(prof, cluster, PlanRequest(gpus=DEMO_RANKS, global_batch_size=DEMO_GLOBAL_BATCH, precision="fp32"),
                  profile_path=str(profile_path), command=command)
    plan_path = out_dir / "plan.json"
    result.save(plan_path, overwrite=True)
    if on_status:
        on_status(f"running the plan on {DEMO_RANKS} ranks for {DEMO_STEPS} steps")
    run = launch(result, RunConfig(steps=DEMO_STEPS, warmup=WARMUP_STEPS))
    assert run is not None   # launch returns None only on nodes without rank 0; the demo runs on one node
    run_path = out_dir / "run.json"
    run.save(run_path, overwrite=True)
    report_path = write_atomic(out_dir / "report.html", render_html(result, run), overwrite=True)
    write_atomic(out_dir / "report.md", render_markdown(result, run), overwrite=True)
    return DemoResult(profile_path=profile_path, plan_path=plan_path, plan=result, run_path=run_path, run=run,
                      report_path=report_path)
