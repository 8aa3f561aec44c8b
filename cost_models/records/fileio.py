"""Atomic, non-clobbering file output and strict JSON input shared by every zeropipe file format (the kind and
schema version of a file are checked by cost_models.records.file_record.FileRecord, which reads and writes through
here)."""
from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

from cost_models.records.errors import FileFormatError, OutputError, OutputExistsError


def write_atomic(path: str | os.PathLike[str], text: str, *, overwrite: bool = False) -> Path:
    """Write `text` to `path` via a temp file + rename, so readers never see a half-written file.

    Refuses to replace an existing file unless `overwrite` (nothing a user made is clobbered silently).
    """
    target = Path(path)
    if target.exists() and not overwrite:
        raise OutputExistsError(f"{target} already exists; pass --force to overwrite it or -o to write elsewhere")
    check_writable(target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    except OSError as exc:
        raise OutputError(f"cannot write {target}: {exc.strerror or exc}; choose another output path") from None
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # mkstemp makes 0600; give the file the permissions open() would
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException as exc:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(exc, OSError):   # a full disk, a folder made read-only meanwhile: one line, not a traceback
            raise OutputError(f"cannot write {target}: {exc.strerror or exc}; nothing was written there") from None
        raise
    return target


# Outputs this process has claimed: resolved path -> the open, flock(2)ed claim file (claim_output)
_CLAIMED: dict[str, int] = {}


def _claims_dir() -> Path:
    """Where claim files live: this user's private runtime folder ($XDG_RUNTIME_DIR/zeropipe), else
    ~/.cache/zeropipe/claims (mode 0700): never beside the user's own files."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) / "zeropipe" if runtime else Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "zeropipe" / "claims"
    base.mkdir(parents=True, exist_ok=True, mode=0o700)
    return base


def claim_output(path: str | os.PathLike[str], command: str = "") -> None:
    """Claim `path` for this process until it exits (or release_outputs): a second planner command writing the same
    file is refused in one line before it starts work, instead of finishing and then finding the file taken. The
    claim is flock(2) on a file named by the path's hash in _claims_dir(): the kernel lets go when the holder dies,
    however it dies. Claiming again in the same process is a no-op."""
    import fcntl
    import hashlib
    key = str(Path(path).resolve())
    if key in _CLAIMED:
        return
    try:
        name = hashlib.sha256(key.encode()).hexdigest()[:32] + ".lock"
        fd = os.open(_claims_dir() / name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError:
        return   # no private folder to claim in (a read-only home): the write itself still refuses to clobber
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pid, _, holder = os.read(fd, 4096).decode(errors="replace").partition("\n")
        os.close(fd)
        who = f"pid {pid.strip() or 'unknown'}" + (f": {holder.splitlines()[0]}" if holder.strip() else "")
        raise OutputExistsError(f"{key} is being written by another planner command ({who}); wait for it to finish "
                                f"or choose another -o") from None
    except OSError:   # no locks here (an NFS home without lockd): no claim, the output path itself is fine
        os.close(fd)
        return
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n{command}\n".encode(), 0)
    except OSError:   # a full or over-quota home: the claim holds, only its note of who holds it is missing
        pass
    _CLAIMED[key] = fd


def release_outputs() -> None:
    """Let go of every claim_output claim this process holds (a command ended, however it ended)."""
    while _CLAIMED:
        os.close(_CLAIMED.popitem()[1])


def check_writable(path: str | os.PathLike[str]) -> None:
    """Refuse, in one line, an output that cannot be written, before any work is spent on it: a folder in its
    place, a file where a parent folder should be, a folder this user cannot write in (a test file is made and
    removed in the nearest existing parent; the folders write_atomic would create are not made here)."""
    target = Path(path)
    if target.is_dir():
        raise OutputError(f"{target} is a folder; name a file to write (e.g. {target / 'out.json'})")
    parent = target.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise OutputError(f"cannot write {target}: {parent} is a file, not a folder")
    try:
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as exc:
        raise OutputError(f"cannot write {target}: {exc.strerror or exc} ({parent}); choose another output path") from None


def dumps(data: Any) -> str:
    """JSON text of `data`. allow_nan=False: NaN and Infinity are not JSON (RFC 8259 section 6) and no other reader
    takes them; a ValueError here means a non-finite number got past validation, which is a bug."""
    return json.dumps(data, indent=2, sort_keys=False, allow_nan=False) + "\n"


class _NonFinite:
    """Stands in, while parsing, for a NaN / Infinity / -Infinity literal or a number too large for a float (1e400)."""

    def __init__(self, text: str) -> None:
        self.text = text


def _finite_float(text: str) -> float | _NonFinite:
    value = float(text)
    return value if math.isfinite(value) else _NonFinite(text)


def _first_non_finite(value: Any, path: str) -> tuple[str, str] | None:
    """(JSON path, literal) of the first _NonFinite in parsed data, depth first in file order."""
    if isinstance(value, _NonFinite):
        return path or "(top level)", value.text
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        at = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else key
        found = _first_non_finite(item, at)
        if found:
            return found
    return None


def parse_json(text: str, where: str) -> Any:
    """Parse JSON text, refusing what Python's json module accepts beyond the standard: NaN, Infinity and
    -Infinity literals, and numbers that overflow a float. Every zeropipe number must be finite."""
    try:
        data = json.loads(text, parse_constant=_NonFinite, parse_float=_finite_float)
        bad = _first_non_finite(data, "")
    except RecursionError:
        raise FileFormatError(f"{where}: not valid JSON (nested too deeply)") from None
    except ValueError as exc:  # JSONDecodeError, or an integer beyond Python's 4300-digit conversion limit
        raise FileFormatError(f"{where}: not valid JSON ({str(exc).splitlines()[0]})") from None
    if bad:
        raise FileFormatError(f"{where}: {bad[0]} is {bad[1]}; JSON numbers must be finite: write a number "
                              f"or re-create the file")
    return data


def read_bytes(path: str | os.PathLike[str]) -> bytes:
    """The bytes of a file the user named, or one line saying why not: missing, a folder, unreadable."""
    p = Path(path)
    if p.is_dir():
        raise FileFormatError(f"{p}: a folder, not a file")
    if not p.is_file():
        raise FileFormatError(f"{p}: no such file")
    try:
        return p.read_bytes()
    except OSError as exc:
        raise FileFormatError(f"{p}: cannot read ({exc.strerror})") from None


def decode(data: bytes, where: str) -> str:
    """UTF-8 text of a file's bytes (JSON and YAML files are UTF-8), or one line naming the first bad byte."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FileFormatError(f"{where}: not a text file ({exc.reason} at byte {exc.start})") from None
