"""The config's keys as people read them (`trainbox config schema`): each settable dotted key with its type,
bounds, default and description, from the RunConfig tree in config/schema.py."""
from __future__ import annotations

import json
import types
import typing
from typing import Literal

from pydantic import BaseModel

from trainbox.config.schema import RunConfig
from trainbox.model.spec import OPTIONS, either, families, which


def _type_name(tp) -> str:
    """A config annotation as users write values: `int | None`, `auto|shard|megatron`, `list[str] | str`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "|".join(str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(_type_name(a) for a in args)}]"
    if tp is type(None):
        return "None"
    return getattr(tp, "__name__", str(tp))


def _bounds(metadata) -> str:
    signs = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    out = []
    for m in metadata:
        for attr, sign in signs.items():
            v = getattr(m, attr, None)
            if v is not None and type(m).__name__.lower() == attr:
                out.append(f"{sign}{v}")
    return ", ".join(out)


def describe_keys(model: type[BaseModel] = None, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """Every settable key of `model` (default RunConfig), depth first: (dotted key, type with bounds, default,
    description). What `trainbox config schema` prints."""
    model = model or RunConfig
    rows = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        tp = field.annotation
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            rows.extend(describe_keys(tp, f"{key}."))
            continue
        default = field.get_default(call_default_factory=True)
        type_s = _type_name(tp)
        bounds = _bounds(field.metadata)
        rows.append((key, f"{type_s} ({bounds})" if bounds else type_s, _default_text(default),
                     _with_families(key, field.description or "")))
    return rows


def _with_families(key: str, description: str) -> str:
    """A generic model option's description, with the families that read it (asked of each family)."""
    name = key.removeprefix("model.")
    if key == "model.family":
        return f"{description}: " + "; ".join(f"{n}, {f.summary}" for n, f in families().items())
    if name not in OPTIONS:
        return description
    return f"[{either(which(lambda f: f.supports(name)))}] {description}"


def _default_text(value) -> str:
    """A default as it would be written in an override: null, true, 1e-06, [text], a quoted string only when
    it is empty or holds whitespace."""
    if isinstance(value, str):
        return json.dumps(value) if not value or any(c.isspace() for c in value) else value
    if isinstance(value, tuple):
        value = list(value)
    return json.dumps(value)
