"""Frozen, keyword-only dataclasses that round-trip through plain JSON data.

Every record in zeropipe derives from `Record`: `to_dict()` gives JSON-ready data and `from_dict()` rebuilds the
record, checking field names so that a file from another schema fails with one clear line, not a TypeError.
Tuples stand in for lists so that records stay immutable and hashable.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, ClassVar, TypeVar

from typing_extensions import dataclass_transform  # typing's own from Python 3.11; torch depends on the package

from cost_models.records.errors import FileFormatError

T = TypeVar("T", bound="Record")


@dataclass_transform(frozen_default=True, kw_only_default=True)   # PEP 681: type checkers see the dataclass
def record(cls: type[T]) -> type[T]:
    """Class decorator: a frozen, keyword-only dataclass (the house style for every data type)."""
    return dataclasses.dataclass(frozen=True, kw_only=True)(cls)


class Record:
    """Mixin giving `to_dict` / `from_dict` to a `@record` dataclass."""

    _hints_cache: ClassVar[dict[type, dict[str, Any]]] = {}

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _dump(getattr(self, f.name)) for f in dataclasses.fields(self)}  # type: ignore[arg-type]

    @classmethod
    def from_dict(cls: type[T], data: dict[str, Any]) -> T:
        if not isinstance(data, dict):
            raise FileFormatError(f"expected an object for {cls.__name__}, got {type(data).__name__}")
        hints = Record._hints_cache.get(cls)
        if hints is None:
            hints = typing.get_type_hints(cls)
            Record._hints_cache[cls] = hints
        fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = set(data) - set(fields)
        if unknown:
            raise FileFormatError(f"{cls.__name__}: unknown field(s) {sorted(unknown)}; is the file from another schema version?")
        kwargs = {}
        for name, f in fields.items():
            if name in data:
                kwargs[name] = _load(hints[name], data[name], f"{cls.__name__}.{name}")
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise FileFormatError(f"{cls.__name__}: missing field '{name}'")
        return cls(**kwargs)


def _dump(value: Any) -> Any:
    if isinstance(value, Record):
        return value.to_dict()
    if isinstance(value, (tuple, list)):
        return [_dump(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _dump(v) for k, v in value.items()}
    return value


def _load(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:
            return _load(options[0], value, where)
        for option in options:  # first option that loads cleanly wins (only scalar unions are used)
            try:
                return _load(option, value, where)
            except (FileFormatError, TypeError, ValueError):
                continue
        raise FileFormatError(f"{where}: value {value!r} matches none of {tp}")
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise FileFormatError(f"{where}: expected a list, got {type(value).__name__}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_load(args[0], v, where) for v in value)
        return tuple(_load(a, v, where) for a, v in zip(args, value))
    if origin is dict:
        if not isinstance(value, dict):
            raise FileFormatError(f"{where}: expected an object, got {type(value).__name__}")
        kt, vt = args or (str, Any)
        return {_load(kt, k, where): _load(vt, v, where) for k, v in value.items()}
    if origin is typing.Literal:
        if value not in args:
            raise FileFormatError(f"{where}: {value!r} is not one of {list(args)}")
        return value
    if isinstance(tp, type) and issubclass(tp, Record):
        return tp.from_dict(value)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise FileFormatError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise FileFormatError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is str and not isinstance(value, str):
        raise FileFormatError(f"{where}: expected a string, got {value!r}")
    if tp is bool and not isinstance(value, bool):
        raise FileFormatError(f"{where}: expected true/false, got {value!r}")
    return value
