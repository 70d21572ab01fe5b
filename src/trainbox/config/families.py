"""The Section every part of the RunConfig tree (config/schema.py) derives from: unknown keys refused (extra="forbid"),
values checked on assignment too, no infinities or NaNs. The model families' own sections derive from it in their
folders (model/<family>/config.py)."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)
