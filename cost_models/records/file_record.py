"""A zeropipe file as one record: its kind and schema version declared once, loaded and saved in one place.

The five file kinds (profile.json, cluster files, plan.json, run.json, a checkpoint's zeropipe-checkpoint.json)
derive from `FileRecord`. Loading refuses each way a file can be wrong with one line that starts with the file's
name: missing, a folder, unreadable, not UTF-8, not valid JSON, another kind, another schema version, a field
missing, unknown or mistyped, or a value the subclass's `check` refuses.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from cost_models.records.base import Record
from cost_models.records.errors import ConfigError, FileFormatError
from cost_models.records.fileio import decode, dumps, parse_json, read_bytes, write_atomic

F = TypeVar("F", bound="FileRecord")


class FileRecord(Record):
    """Base of every zeropipe file. A subclass is a `@record` whose first two fields say what it is, once:

        schema_version: int = N        # bump when the format changes
        kind: str = "zeropipe.NAME"

    and may override `check` (values the types allow but the planner cannot use) and, to read more than JSON,
    `parse`."""

    # what the reader of a file of another schema version is told to do
    REWRITE: ClassVar[str] = "re-create the file"

    @classmethod
    def header(cls) -> tuple[str, int]:
        """(kind, schema_version) this class reads and writes: its fields' defaults."""
        fields = {f.name: f.default for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        kind, version = fields.get("kind"), fields.get("schema_version")
        if not isinstance(kind, str) or not isinstance(version, int):
            raise TypeError(f"{cls.__name__} needs defaults for its kind and schema_version fields")
        return kind, version

    @classmethod
    def load(cls: type[F], path: str | os.PathLike[str]) -> F:
        """Read and check the file at `path`."""
        return cls.from_bytes(read_bytes(path), str(path))

    @classmethod
    def from_bytes(cls: type[F], data: bytes, where: str) -> F:
        """The record in `data`, the bytes of the file `where` as already read (a signed file is parsed from the
        very bytes whose signature was checked)."""
        return cls.from_data(cls.parse(decode(data, where), where), where)

    @classmethod
    def parse(cls, text: str, where: str) -> Any:
        """The file's text as plain data (strict JSON: no NaN or Infinity)."""
        return parse_json(text, where)

    @classmethod
    def from_data(cls: type[F], data: Any, where: str) -> F:
        """The record in parsed data, its kind, version, fields and values checked."""
        kind, version = cls.header()
        found = data.get("kind") if isinstance(data, dict) else None
        if found != kind:
            short = kind.rpartition(".")[2]
            raise FileFormatError(f"{where}: not a zeropipe {short} file (its 'kind' is {found!r}; a {short} file "
                                  f"has kind: {kind}, schema_version: {version})")
        if data.get("schema_version") != version:
            raise FileFormatError(f"{where}: schema_version {data.get('schema_version')!r}, this zeropipe reads "
                                  f"{version}; {cls.REWRITE}")
        try:
            record = cls.from_dict(data)
        except (ConfigError, TypeError, ValueError, AttributeError) as exc:  # a field missing, unknown or mistyped
            raise FileFormatError(f"{where}: {exc}") from None
        record.check(where)
        return record

    def check(self, where: str) -> None:
        """Refuse, with a FileFormatError whose line starts with `where`, values the field types allow but the
        planner cannot use. Nothing by default."""

    def save(self, path: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
        """Write the file atomically; an existing file is replaced only with `overwrite`."""
        return write_atomic(path, self.dumps(), overwrite=overwrite)

    def dumps(self) -> str:
        """The file's JSON text."""
        return dumps(self.to_dict())
