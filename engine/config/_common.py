"""What the configuration's sections share: the strict base model, participant-like entries (a name
and an http(s) URL that carries no credentials) and the check that names are unique."""

from __future__ import annotations

import re
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, field_validator

#: A URL's user information: a user name, then (after ``:``) a password that may hold ``/``,
#: ``@`` and anything else, up to the LAST ``@`` in the value. Hiding too much (``x:1/a@b``) is
#: harmless; hiding too little would leak part of a password.
_USERINFO = re.compile(r"(://)[^:/@\s]*(?::[\s\S]*)?@")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class _Strict(BaseModel):
    # No infinities or NaN anywhere: `.inf` passes `gt=0` and would mean "never" (a lease never held).
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class ParticipantEntry(_Strict):
    name: str
    url: str

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError(f"{v!r} must match {_NAME.pattern}")
        return v

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        if not re.match(r"^https?://[^/\s]+", v):
            shown = _USERINFO.sub(r"\1***@", v)
            raise ValueError(f"{shown!r} is not an http(s) URL")
        if _USERINFO.search(v):
            # The URL is recorded in the journal; credentials belong in control.token.
            raise ValueError("must not carry credentials (user:password@); use control.token "
                             "or TIDELOG_CONTROL_TOKEN")
        return v.rstrip("/")


E = TypeVar("E", bound=ParticipantEntry)


def _unique_names(entries: list[E], what: str) -> list[E]:
    """``entries`` unchanged, or a ValueError naming the first name given twice."""
    seen: set[str] = set()
    for e in entries:
        if e.name in seen:
            raise ValueError(f"{what} name {e.name!r} appears twice")
        seen.add(e.name)
    return entries


__all__ = ["E", "ParticipantEntry", "_NAME", "_USERINFO", "_Strict", "_unique_names"]
