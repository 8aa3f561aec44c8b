"""`planner demo`: the main job end to end on a built-in default, on this machine.

Built so far: the model profile (real mode, gpt-tiny), the probe of this machine (4 gloo ranks), and estimates of
pure ZeRO, pure pipeline and a hybrid on those ranks. Not built yet, and said so in the demo's output: the plan
search and its report (issues 5, 7) and the real run (issue 6).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cost_models.cluster import ClusterProfile
from cost_models.cluster_source import StatusFn, probe_local
from cost_models.fileio import dumps, write_atomic
from cost_models.model_profiler import ProgressFn, profile_model
from cost_models.models.source import resolve
from cost_models.estimate import Estimate, estimate
from cost_models.profile import ModelProfile, ProfileFile
from cost_models.strategy import Strategy
from planner.manual import build_strategy

DEMO_MODEL = "gpt-tiny"
DEMO_MICRO_BATCH = 4
DEMO_SEQ_LEN = 64
DEMO_RANKS = 4
DEMO_GLOBAL_BATCH = 128   # sequences per step, the same for every strategy compared
# (dp, pp, zero, schedule): ZeRO alone, a pipeline alone, and the hybrid, on the same 4 ranks.
DEMO_STRATEGIES = ((4, 1, 1, "1f1b"), (4, 1, 3, "1f1b"), (1, 4, 0, "1f1b"), (2, 2, 1, "1f1b"))
NOT_YET_BUILT = ("plan search", "report", "real run")


@dataclass(frozen=True)
class DemoResult:
    profile_path: Path
    profile: ModelProfile
    cluster: ClusterProfile
    estimates: tuple[tuple[Strategy, Estimate], ...]
    not_yet_built: tuple[str, ...]


def run_demo(out_dir: Path, *, command: str = "", on_progress: ProgressFn | None = None,
             on_status: StatusFn | None = None) -> DemoResult:
    """Profile the demo model and probe this machine into out_dir/profile.json (the demo's own file, rewritten)."""
    prof = profile_model(resolve(DEMO_MODEL), micro_batch_size=DEMO_MICRO_BATCH, seq_len=DEMO_SEQ_LEN, dtype="fp32",
                         command=command, on_progress=on_progress)
    cluster = probe_local(ranks=DEMO_RANKS, dtype="fp32", sizes=None, on_status=on_status)
    path = write_atomic(out_dir / "profile.json", dumps(ProfileFile(model=prof, cluster=cluster).to_dict()), overwrite=True)
    estimates = []
    for dp, pp, zero, schedule in DEMO_STRATEGIES:
        strategy = build_strategy(prof, cluster, dp=dp, pp=pp, zero=zero, schedule=schedule, precision="fp32",
                                  microbatches=DEMO_GLOBAL_BATCH // (dp * DEMO_MICRO_BATCH))
        estimates.append((strategy, estimate(strategy, prof, cluster)))
    return DemoResult(profile_path=path, profile=prof, cluster=cluster, estimates=tuple(estimates),
                      not_yet_built=NOT_YET_BUILT)
