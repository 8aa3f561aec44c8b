"""Where checkpoints live on disk, how one becomes complete, and how a damaged one is recognised.

    DIR/step-00000006/            a complete checkpoint: 6 optimizer steps done
        .metadata, __R_I.distcp   torch.distributed.checkpoint (DCP) files, written by every rank in parallel
        zeropipe-checkpoint.json  CheckpointMeta: step, data position, seed, lr, the plan, size + sha256 per file
        zeropipe-checkpoint.sig   hex HMAC-SHA256 of the meta file's bytes under this installation's key (trust.py)
    DIR/.incomplete-step-00000009/  a save in progress (or killed): never read
    DIR/.zeropipe.lock            held (flock) by the run saving into DIR; records its pid and command

Complete or invisible: ranks write into the .incomplete- folder; only after every rank's DCP write returned and
the meta (with every file's digest) is in it does rank 0 rename it to step-N (rename is atomic on POSIX, so a
reader sees the whole checkpoint or none of it). A step-N folder without the meta was not made by that protocol
and is skipped like an incomplete one; a step-N whose files differ from the digests in its meta is damaged, and
resuming from it fails in one line that names the latest checkpoint before it that verifies.

Resuming runs code a checkpoint carries (torch's DCP reader unpickles `.metadata`), so the launcher checks, before
any rank reads a byte of DCP data, that the meta is signed by this installation's key, then that every file it
lists has its size and sha256: the signature vouches for the digests, the digests for the files.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import re
import shutil
import stat
from pathlib import Path
from typing import Iterator

from cost_models.records.base import Record, record
from cost_models.records.errors import ConfigError, FileFormatError
from cost_models.records.file_record import FileRecord
from cost_models.records.fileio import write_atomic
from cost_models.records.formatting import now_utc
from executor import trust
from planner.plan import Plan

CHECKPOINT_KIND = "zeropipe.checkpoint"
CHECKPOINT_SCHEMA_VERSION = 1
META_NAME = "zeropipe-checkpoint.json"
SIG_NAME = "zeropipe-checkpoint.sig"
LOCK_NAME = ".zeropipe.lock"
_STEP_DIR = re.compile(r"^step-(\d{8})$")
_INCOMPLETE_DIR = re.compile(r"^\.incomplete-step-(\d{8})$")


class CheckpointError(ConfigError):
    """A checkpoint that cannot be resumed from (missing, incomplete, damaged, unsigned, or made for another model),
    or a checkpoint folder that cannot be written to now."""


class CheckpointSaveError(CheckpointError):
    """Writing a checkpoint failed (a full disk, a file size limit); its partial folder was removed."""


@record
class FileDigest(Record):
    name: str
    bytes: int
    sha256: str


@record
class CheckpointMeta(FileRecord):
    """zeropipe-checkpoint.json: what a checkpoint holds and where training stands, signed (SIG_NAME)."""

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
    data: str | None = None             # executor.data.data_identity of the --data file; "" synthetic tokens;
                                        # None in older checkpoints (not recorded)


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
        if not _STEP_DIR.match(p.name):   # a save in progress (or killed before its rename), or a renamed folder
            raise CheckpointError(f"{p} is not a committed checkpoint (those are named step-NNNNNNNN); resume from "
                                  f"its parent folder to take the latest complete one")
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


def read_meta(step_dir: Path, meta_bytes: bytes | None = None) -> CheckpointMeta:
    """The checkpoint's listing: parsed from `meta_bytes` when given (the bytes whose signature was checked, so a
    file swapped after the check is never what is used), else read from disk."""
    where = step_dir / META_NAME
    try:
        if meta_bytes is None:
            return CheckpointMeta.load(where)
        return CheckpointMeta.from_bytes(meta_bytes, str(where))
    except FileFormatError as exc:
        raise CheckpointError(f"checkpoint {step_dir} is damaged ({exc}){_earlier_hint(step_dir)}") from None


def read_verified(step_dir: Path, *, trusted: bool = False) -> tuple[CheckpointMeta, bool]:
    """(the listing, whether this installation's key signed it): the listing is read once, its signature checked
    on those bytes (check_signature), and the meta parsed from the same bytes."""
    try:
        meta_bytes = (step_dir / META_NAME).read_bytes()
    except OSError as exc:
        raise CheckpointError(f"checkpoint {step_dir}: cannot read {META_NAME} ({exc.strerror})") from None
    signed = check_signature(step_dir, trusted=trusted, meta_bytes=meta_bytes)
    return read_meta(step_dir, meta_bytes), signed


def digest(path: Path) -> FileDigest:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return FileDigest(name=path.name, bytes=path.stat().st_size, sha256=h.hexdigest())


def check_signature(step_dir: Path, *, trusted: bool = False, meta_bytes: bytes | None = None) -> bool:
    """Whether the meta of `step_dir` (or `meta_bytes`, its bytes as already read) is signed by this installation's
    key; when it is not, refuse in one line unless the user said they trust the checkpoint (`trusted`). Reads only
    the meta and the signature."""
    problem = _signature_problem(step_dir, trust.key_path(), meta_bytes)
    if problem is None:
        return True
    if problem.startswith("is damaged"):   # one's own checkpoint, changed: trusting it would not mend it
        raise CheckpointError(f"checkpoint {step_dir} {problem}{_earlier_hint(step_dir)}")
    if trusted:
        return False
    raise CheckpointError(f"checkpoint {step_dir} {problem}: resuming runs code stored in it (torch DCP unpickles "
                          f"its .metadata); pass --trust-checkpoint if you made it or trust who did")


def _signature_problem(step_dir: Path, key_file: Path, meta_bytes: bytes | None = None) -> str | None:
    sig = step_dir / SIG_NAME
    if not sig.is_file():
        return f"is not signed (it has no {SIG_NAME})"
    key = trust.load_key(key_file)
    if key is None:
        return (f"is signed, but this installation has no key to check it ({key_file}; set {trust.KEY_ENV} to the "
                f"key file of the installation that made it)")
    try:
        signature = sig.read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError):
        signature = ""
    if meta_bytes is None:
        meta_bytes = (step_dir / META_NAME).read_bytes()
    if not trust.verify(meta_bytes, signature, key):
        if trust.signed_by(signature, key):   # this key signed a listing that has changed since
            return f"is damaged: its {META_NAME} no longer matches the signature this installation's key made"
        return f"is not signed by this installation's key ({key_file})"
    return None


def verify(step_dir: Path, meta: CheckpointMeta) -> None:
    """Every file the meta lists is there with its size and sha256 (sizes first: truncation shows without
    reading). Reads the checkpoint once."""
    problem = _file_problem(step_dir, meta)
    if problem:
        raise CheckpointError(f"checkpoint {step_dir} is damaged: {problem}{_earlier_hint(step_dir)}")


def _file_problem(step_dir: Path, meta: CheckpointMeta) -> str | None:
    for f in meta.files:
        path = step_dir / f.name
        if not path.is_file():
            return f"{f.name} is missing"
        size = path.stat().st_size
        if size != f.bytes:
            return f"{f.name} has {size:,} of its {f.bytes:,} bytes"
    for f in meta.files:
        if digest(step_dir / f.name).sha256 != f.sha256:
            return f"{f.name} does not match its sha256"
    return None


def _verifies(step_dir: Path, key_file: Path) -> bool:
    """The checks a resume makes, without raising: the signature (when this installation has a key: without one
    nothing can be signed here), the meta, every file's size and sha256."""
    try:
        if key_file.is_file() and _signature_problem(step_dir, key_file) is not None:
            return False
        meta = CheckpointMeta.load(step_dir / META_NAME)
        return _file_problem(step_dir, meta) is None
    except (ConfigError, OSError):
        return False


def _earlier_hint(step_dir: Path) -> str:
    """Which checkpoint to resume from instead: the latest earlier one that passes every check (an earlier one can
    be damaged too; each candidate is read whole, newest first, only on this error path)."""
    m = _STEP_DIR.match(step_dir.name)
    earlier = [d for s, d in complete_steps(step_dir.parent) if m and s < int(m.group(1))]
    key_file = trust.key_path()
    good = next((d for d in reversed(earlier) if _verifies(d, key_file)), None)
    if good is None:
        what = "earlier checkpoint there verifies" if earlier else "earlier complete checkpoint is there"
        return f"; no {what}, so start without --resume"
    return f"; resume from {good}, the latest checkpoint before it that verifies"


def commit(root: Path, step: int, meta_fields: dict, files: list[FileDigest]) -> Path:
    """Rank 0, after every rank's DCP write returned: put the meta and its signature in the incomplete folder,
    then rename it."""
    tmp = incomplete_dir(root, step)
    listed = {f.name for f in files}
    files = files + [digest(p) for p in sorted(tmp.iterdir()) if p.is_file() and p.name not in listed]
    meta = CheckpointMeta(step=step, files=tuple(sorted(files, key=lambda f: f.name)),
                          created_at=now_utc(), **meta_fields)
    meta.save(tmp / META_NAME)
    signature = trust.signature_line((tmp / META_NAME).read_bytes(), trust.load_or_create_key(trust.key_path()))
    write_atomic(tmp / SIG_NAME, signature + "\n")
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
    older than the newest complete one. Only step folders are touched (never the lock file)."""
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


@contextlib.contextmanager
def locked(root: Path, command: str) -> Iterator[None]:
    """Hold `root`'s lock for a run that saves into it: two runs sharing a folder would delete each other's saves
    in progress. flock(2) is released by the kernel when its holder exits however it dies, so no lock outlives its
    run; the file stays (removing it would let a third run lock a new file while the second holds the old one)."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        # O_NOFOLLOW: a symlink planted as the lock file must not make a run truncate the file it points at
        fd = os.open(root / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        why = (f"{LOCK_NAME} is a symbolic link; remove it" if exc.errno == errno.ELOOP else exc.strerror)
        raise CheckpointError(f"cannot use --checkpoint-dir {root}: {why}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):   # a FIFO or device planted there is no lock to truncate
        os.close(fd)
        raise CheckpointError(f"cannot use --checkpoint-dir {root}: {LOCK_NAME} is not a regular file; remove it")
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid, _, holder = os.read(fd, 4096).decode(errors="replace").partition("\n")
            who = f"pid {pid.strip() or 'unknown'}" + (f": {holder.strip()}" if holder.strip() else "")
            raise CheckpointError(f"checkpoint folder {root} is in use by another planner run ({who}); wait for it "
                                  f"to finish or choose another --checkpoint-dir") from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n{command}\n".encode(), 0)
        except OSError as exc:
            raise CheckpointError(f"cannot use --checkpoint-dir {root}: {exc.strerror}") from None
        yield
    finally:
        os.close(fd)


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
