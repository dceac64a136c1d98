"""Dataclasses that are JSON objects: :class:`Record`, the base of the typed ``dspark bench`` result.

JSON keys are the field names, in field order. :meth:`Record.from_json` loads leniently and :meth:`Record.to_json`
gives back exactly what was loaded: a key absent from the JSON gets the field's default (``None`` without one) and
stays absent when written again (unless it was set since); keys the class does not know are kept and written after
the known ones. Nested records, and lists and ``str``-keyed dicts of them, are typed from the field annotations;
other values are kept as they are (no coercion), and non-finite floats are written as ``null``.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing

__all__ = ["Record"]


class Record:
    """Base of the result's dataclasses: :meth:`from_json` and :meth:`to_json`, keys = field names.

    A field with ``metadata={"omit_none": True}`` is left out of :meth:`to_json` while it is ``None`` (a key that a
    record gains later, as ``plots`` once the PNGs are written).
    """

    _absent: frozenset = frozenset()  # fields whose key the loaded JSON lacked
    _extra: typing.Mapping = types.MappingProxyType({})  # keys of the loaded JSON that are no field

    @classmethod
    def from_json(cls, data: dict):
        """Load from a JSON object; nested records, lists and dicts of them are typed too, values are not coerced."""
        hints = typing.get_type_hints(cls)
        values, absent = {}, set()
        for f in dataclasses.fields(cls):
            if f.name in data:
                values[f.name] = _load(hints[f.name], data[f.name])
            else:
                values[f.name] = _fill(f)
                absent.add(f.name)
        record = cls(**values)
        object.__setattr__(record, "_absent", frozenset(absent))
        object.__setattr__(record, "_extra", {k: v for k, v in data.items() if k not in values})
        return record

    def to_json(self) -> dict:
        """A strict-JSON object (non-finite floats as ``None``), keys in field order, then the unknown ones kept."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if (f.name in self._absent and value == _fill(f)) or (value is None and f.metadata.get("omit_none")):
                continue
            out[f.name] = _dump(value)
        return out | {k: _dump(v) for k, v in self._extra.items()}


def _fill(f: dataclasses.Field):
    """The value of a field whose key is absent: its default, else ``None``."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _load(tp, value):
    """``value`` (parsed JSON) as the annotation ``tp`` says: records, lists and dicts of them; others as they are."""
    if value is None:
        return None
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        return _load(options[0], value) if len(options) == 1 else value
    if isinstance(tp, type) and issubclass(tp, Record):
        return tp.from_json(value) if isinstance(value, dict) else value
    if origin is dict and isinstance(value, dict):
        return {k: _load(args[1], v) for k, v in value.items()}
    if origin is list and isinstance(value, list):
        return [_load(args[0], v) for v in value]
    return value


def _dump(value):
    """Records, dicts, lists and tuples to JSON values; NaN and infinities to ``None``."""
    if isinstance(value, Record):
        return value.to_json()
    if isinstance(value, dict):
        return {k: _dump(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_dump(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
