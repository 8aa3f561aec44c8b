"""`planner demo`: the main job end to end on a built-in default, on this machine.

Built so far: the model profile (real mode, gpt-tiny). Not built yet, and said so in the demo's output:
the cluster probe (issue 3), the estimate (issue 4), the plan and its report (issues 5, 7) and the real run (issue 6).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cost_models.fileio import dumps, write_atomic
from cost_models.model_profiler import ProgressFn, profile_model
from cost_models.models.source import resolve
from cost_models.profile import ModelProfile, ProfileFile

DEMO_MODEL = "gpt-tiny"
DEMO_MICRO_BATCH = 4
DEMO_SEQ_LEN = 64
NOT_YET_BUILT = ("cluster probe", "plan", "report", "real run")


@dataclass(frozen=True)
class DemoResult:
    profile_path: Path
    profile: ModelProfile
    not_yet_built: tuple[str, ...]


def run_demo(out_dir: Path, *, command: str = "", on_progress: ProgressFn | None = None) -> DemoResult:
    """Profile the demo model for real into out_dir/profile.json (overwriting the demo's own earlier output)."""
    prof = profile_model(resolve(DEMO_MODEL), micro_batch_size=DEMO_MICRO_BATCH, seq_len=DEMO_SEQ_LEN, dtype="fp32",
                         command=command, on_progress=on_progress)
    path = write_atomic(out_dir / "profile.json", dumps(ProfileFile(model=prof).to_dict()), overwrite=True)
    return DemoResult(profile_path=path, profile=prof, not_yet_built=NOT_YET_BUILT)
