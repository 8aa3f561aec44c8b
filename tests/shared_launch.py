"""Several models' multi-process runs in one launch (each launch spawns ranks that import torch, and transformers
where a model needs it: seconds each on a small machine), for tests whose cases differ only in the model."""
from __future__ import annotations

from typing import Any

from executor.launch import run_many


def run_shared(ranks: int, jobs: list[tuple[Any, Any, list, list | None]]) -> dict[Any, list]:
    """Run `jobs`, each (key, its TrainConfig or one per strategy, its strategies, their plans or None), on one set
    of `ranks` local ranks: {key: that job's [strategy][rank] results}."""
    strategies, cfgs, plans = [], [], []
    for _, cfg, ss, ps in jobs:
        strategies += ss
        cfgs += cfg if isinstance(cfg, list) else [cfg] * len(ss)
        plans += ps or [None] * len(ss)
    results = run_many(ranks, strategies, cfgs, plans=plans)
    out, at = {}, 0
    for key, _, ss, _ in jobs:
        out[key] = results[at:at + len(ss)]
        at += len(ss)
    return out
