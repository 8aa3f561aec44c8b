"""`planner demo`: the main job end to end on a built-in default, on this machine.

Built so far: the model profile (real mode, gpt-tiny) and the probe of this machine (4 gloo ranks). Not built
yet, and said so in the demo's output: the estimate (issue 4), the plan and its report (issues 5, 7) and the real
run (issue 6).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cost_models.cluster import ClusterProfile
from cost_models.cluster_source import StatusFn, probe_local
from cost_models.fileio import dumps, write_atomic
from cost_models.model_profiler import ProgressFn, profile_model
from cost_models.models.source import resolve
from cost_models.profile import ModelProfile, ProfileFile

DEMO_MODEL = "gpt-tiny"
DEMO_MICRO_BATCH = 4
DEMO_SEQ_LEN = 64
DEMO_RANKS = 4
NOT_YET_BUILT = ("plan", "report", "real run")


@dataclass(frozen=True)
class DemoResult:
    profile_path: Path
    profile: ModelProfile
    cluster: ClusterProfile
    not_yet_built: tuple[str, ...]


def run_demo(out_dir: Path, *, command: str = "", on_progress: ProgressFn | None = None,
             on_status: StatusFn | None = None) -> DemoResult:
    """Profile the demo model and probe this machine into out_dir/profile.json (the demo's own file, rewritten)."""
    prof = profile_model(resolve(DEMO_MODEL), micro_batch_size=DEMO_MICRO_BATCH, seq_len=DEMO_SEQ_LEN, dtype="fp32",
                         command=command, on_progress=on_progress)
    cluster = probe_local(ranks=DEMO_RANKS, dtype="fp32", sizes=None, on_status=on_status)
    path = write_atomic(out_dir / "profile.json", dumps(ProfileFile(model=prof, cluster=cluster).to_dict()), overwrite=True)
    return DemoResult(profile_path=path, profile=prof, cluster=cluster, not_yet_built=NOT_YET_BUILT)
