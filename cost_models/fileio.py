"""Atomic, non-clobbering file output and schema-checked JSON input shared by every zeropipe file format."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from cost_models.errors import FileFormatError, OutputExistsError


def write_atomic(path: str | os.PathLike[str], text: str, *, overwrite: bool = False) -> Path:
    """Write `text` to `path` via a temp file + rename, so readers never see a half-written file.

    Refuses to replace an existing file unless `overwrite` (nothing a user made is clobbered silently).
    """
    target = Path(path)
    if target.exists() and not overwrite:
        raise OutputExistsError(f"{target} already exists; pass --force to overwrite it or -o to write elsewhere")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # mkstemp makes 0600; give the file the permissions open() would
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return target


def dumps(data: Any) -> str:
    return json.dumps(data, indent=2, sort_keys=False) + "\n"


def read_json(path: str | os.PathLike[str], *, kind: str, schema_version: int) -> dict[str, Any]:
    """Read a zeropipe JSON file, checking that it exists, parses, and has the expected kind and schema version."""
    p = Path(path)
    if not p.is_file():
        raise FileFormatError(f"{p}: no such file")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise FileFormatError(f"{p}: not valid JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("kind") != kind:
        raise FileFormatError(f"{p}: not a zeropipe {kind} file (its 'kind' is {data.get('kind') if isinstance(data, dict) else None!r})")
    if data.get("schema_version") != schema_version:
        raise FileFormatError(
            f"{p}: schema_version {data.get('schema_version')!r}, this zeropipe reads {schema_version}; re-create the file"
        )
    return data
