"""The Section every part of the RunConfig tree (config/schema.py) derives from: unknown keys refused (extra="forbid"),
values checked on assignment too, no infinities or NaNs, numbers read as numbers. The model families' own sections
derive from it in their folders (model/<family>/config.py). It sits outside trainbox.config so that a family's section
is defined without loading the config tree, which is assembled from the families: a program whose first import is a
family's package gets that family in the tree."""
from __future__ import annotations

import re
import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

SCIENTIFIC = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")   # 1e9, 2.5E+3: what YAML 1.1 leaves a string


def number_types(annotation: Any) -> set[type]:
    """The number types (int, float, bool) a field's annotation admits, through unions, Optional, tuples and lists."""
    if annotation in (int, float, bool):
        return {annotation}
    if typing.get_origin(annotation) is Literal:
        return set()
    return set().union(*(number_types(a) for a in typing.get_args(annotation)))


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _numbers_are_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        """Every int and float field of the tree refuses true and false (pydantic would read true as 1); an int
        field takes a whole number written as 1e9 or 2.0 (a fraction is refused, as pydantic does), and one beyond
        2^63 is refused with the field's bound instead of pydantic's parse error."""
        field = cls.model_fields[info.field_name]
        kinds = number_types(field.annotation)
        if not kinds or bool in kinds:
            return value
        if any(isinstance(v, bool) for v in (value if isinstance(value, (list, tuple)) else (value,))):
            raise PydanticCustomError("number_not_bool", "Input should be a number, not true or false")
        if kinds == {int}:
            if isinstance(value, str) and SCIENTIFIC.fullmatch(value.strip()):
                value = float(value)
            if isinstance(value, float) and value.is_integer() and abs(value) >= 2**63:
                raise PydanticCustomError("less_than_equal", "Input should be less than or equal to {le}",
                                          {"le": _largest(field.metadata)})
        return value


def _largest(metadata: list) -> int:
    """The largest value a field's bounds (le, lt) admit; 2^63 - 1 without one."""
    for m in metadata:
        if getattr(m, "le", None) is not None:
            return m.le
        if getattr(m, "lt", None) is not None:
            return m.lt - 1
    return 2**63 - 1
