"""Where checkpoints live on disk, how one becomes complete, and how a damaged one is recognised.

    DIR/step-00000006/            a complete checkpoint: 6 optimizer steps done
        .metadata, __R_I.distcp   torch.distributed.checkpoint (DCP) files, written by every rank in parallel
        zeropipe-checkpoint.json  CheckpointMeta: step, data position, seed, lr, the plan, size + sha256 per file
    DIR/.incomplete-step-00000009/  a save in progress (or killed): never read

Complete or invisible: ranks write into the .incomplete- folder; only after every rank's DCP write returned and
the meta (with every file's digest) is in it does rank 0 rename it to step-N (rename is atomic on POSIX, so a
reader sees the whole checkpoint or none of it). A step-N folder without the meta was not made by that protocol
and is skipped like an incomplete one; a step-N whose files differ from the digests in its meta is damaged, and
resuming from it fails in one line that names the latest complete checkpoint before it.
"""
from __future__ import annotations

import datetime as dt
import hashlib
import os
import re
import shutil
from pathlib import Path

from cost_models.errors import ConfigError, FileFormatError
from cost_models.fileio import dumps, read_json, write_atomic
from cost_models.records import Record, record
from planner.plan import Plan

CHECKPOINT_KIND = "zeropipe.checkpoint"
CHECKPOINT_SCHEMA_VERSION = 1
META_NAME = "zeropipe-checkpoint.json"
_STEP_DIR = re.compile(r"^step-(\d{8})$")
_INCOMPLETE_DIR = re.compile(r"^\.incomplete-step-(\d{8})$")


class CheckpointError(ConfigError):
    """A checkpoint that cannot be resumed from (missing, incomplete, damaged, or made for another model)."""


@record
class FileDigest(Record):
    name: str
    bytes: int
    sha256: str


@record
class CheckpointMeta(Record):
    schema_version: int = CHECKPOINT_SCHEMA_VERSION
    kind: str = CHECKPOINT_KIND
    step: int                           # optimizer steps done; the next step to run has this index
    samples_seen: int                   # data position: sequences consumed (step x global batch)
    seed: int                           # initialisation and synthetic-data seed of the run
    lr: float
    loss: float | None                  # global-batch loss of the last step before the save
    world_size: int                     # ranks that wrote it (RNG states are kept per rank)
    plan: Plan                          # the plan it ran under
    files: tuple[FileDigest, ...]
    torch_version: str
    created_at: str


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def incomplete_dir(root: Path, step: int) -> Path:
    return root / f".incomplete-{step_dir_name(step)}"


def _step_dirs(root: Path, pattern: re.Pattern = _STEP_DIR) -> list[tuple[int, Path]]:
    """(step, folder) of every folder under `root` whose name `pattern` matches, oldest first."""
    if not root.is_dir():
        return []
    return sorted((int(m.group(1)), child) for child in root.iterdir() if (m := pattern.match(child.name)))


def complete_steps(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint under `root` (a meta file present), oldest first."""
    return [(s, d) for s, d in _step_dirs(root) if (d / META_NAME).is_file()]


def resolve(path: str | os.PathLike[str]) -> Path:
    """The checkpoint folder `path` names: itself if it is one, else the latest complete one inside it."""
    p = Path(path)
    if (p / META_NAME).is_file():
        return p
    if _STEP_DIR.match(p.name) and p.is_dir():
        raise CheckpointError(f"{p} is not a complete checkpoint (it has no {META_NAME}: the save did not finish); "
                              f"resume from its parent folder to take the latest complete one")
    if not p.is_dir():
        raise CheckpointError(f"{p}: no such checkpoint folder")
    steps = complete_steps(p)
    if not steps:
        raise CheckpointError(f"{p} holds no complete checkpoint (planner run --checkpoint-dir writes them)")
    return steps[-1][1]


def read_meta(step_dir: Path) -> CheckpointMeta:
    try:
        return CheckpointMeta.from_dict(read_json(step_dir / META_NAME, kind=CHECKPOINT_KIND,
                                                  schema_version=CHECKPOINT_SCHEMA_VERSION))
    except FileFormatError as exc:
        raise CheckpointError(f"checkpoint {step_dir} is damaged ({exc}){_earlier_hint(step_dir)}") from None


def digest(path: Path) -> FileDigest:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return FileDigest(name=path.name, bytes=path.stat().st_size, sha256=h.hexdigest())


def verify(step_dir: Path, meta: CheckpointMeta) -> None:
    """Every file the meta lists is there with its size and sha256 (sizes first: truncation shows without
    reading). Reads the checkpoint once."""
    for f in meta.files:
        path = step_dir / f.name
        if not path.is_file():
            _damaged(step_dir, f"{f.name} is missing")
        size = path.stat().st_size
        if size != f.bytes:
            _damaged(step_dir, f"{f.name} has {size:,} of its {f.bytes:,} bytes")
    for f in meta.files:
        if digest(step_dir / f.name).sha256 != f.sha256:
            _damaged(step_dir, f"{f.name} does not match its sha256")


def _damaged(step_dir: Path, what: str) -> None:
    raise CheckpointError(f"checkpoint {step_dir} is damaged: {what}{_earlier_hint(step_dir)}")


def _earlier_hint(step_dir: Path) -> str:
    m = _STEP_DIR.match(step_dir.name)
    earlier = [d for s, d in complete_steps(step_dir.parent) if m and s < int(m.group(1))]
    if not earlier:
        return "; no earlier complete checkpoint is there, so start without --resume"
    return f"; resume from {earlier[-1]}, the latest complete checkpoint before it"


def commit(root: Path, step: int, meta_fields: dict, files: list[FileDigest]) -> Path:
    """Rank 0, after every rank's DCP write returned: put the meta in the incomplete folder, then rename it."""
    tmp = incomplete_dir(root, step)
    listed = {f.name for f in files}
    files = files + [digest(p) for p in sorted(tmp.iterdir()) if p.is_file() and p.name not in listed]
    meta = CheckpointMeta(step=step, files=tuple(sorted(files, key=lambda f: f.name)),
                          created_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), **meta_fields)
    write_atomic(tmp / META_NAME, dumps(meta.to_dict()))
    final = root / step_dir_name(step)
    if final.exists():   # a stale checkpoint the user allowed us to replace (--overwrite-checkpoints)
        shutil.rmtree(final)
    os.replace(tmp, final)
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)     # make the rename itself durable
    finally:
        os.close(fd)
    return final


def prune(root: Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints (keep <= 0: keep all), and leftovers of killed saves
    older than the newest complete one."""
    steps = complete_steps(root)
    removed = []
    if keep > 0:
        for _, d in steps[:-keep]:
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    newest = steps[-1][0] if steps else -1
    for step, d in _step_dirs(root, _INCOMPLETE_DIR):
        if step < newest:
            shutil.rmtree(d, ignore_errors=True)
    return removed


def newer_than(root: Path, step: int) -> list[Path]:
    """Checkpoint folders under `root` past `step` (complete or not): a run from `step` would replace or bury them."""
    return [d for s, d in _step_dirs(root) if s > step]


def check_resumable(meta: CheckpointMeta, step_dir: Path, plan: Plan, steps: int) -> None:
    """The plan can continue this checkpoint's training: same model, data and optimizer (any layout)."""
    old, new = meta.plan, plan
    pairs = (("model", old.model.source, new.model.source), ("sequence length", old.model.seq_len, new.model.seq_len),
             ("global batch", old.global_batch_size, new.global_batch_size),
             ("optimizer", old.strategy.optimizer, new.strategy.optimizer),
             ("precision", old.strategy.precision, new.strategy.precision))
    for what, was, now in pairs:
        if was != now:
            raise CheckpointError(f"checkpoint {step_dir} was trained with {what} {was}, the plan has {now}; "
                                  f"make the plan with the same {what} (planner replan keeps it)")
    if steps <= meta.step:
        raise CheckpointError(f"checkpoint {step_dir} is at step {meta.step} and --steps {steps} leaves nothing to "
                              f"run; --steps counts from the start of training, so pass more than {meta.step}")
