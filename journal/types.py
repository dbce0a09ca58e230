"""Column types shared by every journal table.

- ``UTCDateTime``: timestamps are always timezone-aware UTC with microseconds,
  whatever the backend stores (SQLite keeps naive ISO text, PostgreSQL
  ``timestamptz``).
- JSON columns use ``sa.JSON`` (declared ``TEXT`` on SQLite, see :class:`JSONText`)
  with the journal's own serializer
  (:func:`dumps`): key order is kept, floats round-trip through ``repr``,
  integers of any size are exact, and NaN or infinities are refused instead of
  being silently turned into ``null``.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Dialect
from sqlalchemy.ext.compiler import compiles

from .errors import InvalidPayload


class Encoded(str):
    """JSON text :func:`dumps` already produced: a JSON column stores it as it is (not as a string)."""

    __slots__ = ()


def dumps(value: Any) -> str:
    """Serialize a JSON column value; refuses what JSON cannot hold exactly. An :class:`Encoded`
    value is already serialized and is returned as it is."""
    if isinstance(value, Encoded):
        return value
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidPayload("json column", str(exc)) from exc


def loads(text: str) -> Any:
    return json.loads(text)


class UTCDateTime(sa.types.TypeDecorator[datetime]):
    """Timezone-aware UTC datetimes on every backend."""

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise InvalidPayload("timestamp", f"naive datetime {value.isoformat()} (journal times are UTC-aware)")
        value = value.astimezone(timezone.utc)
        if dialect.name == "sqlite":
            return value.replace(tzinfo=None)
        return value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=timezone.utc)
        return value.astimezone(timezone.utc)


class JSONText(sa.JSON):
    """``sa.JSON`` that SQLite declares ``TEXT`` (PostgreSQL: ``json``, which keeps the text).

    SQLite gives a column declared ``JSON`` NUMERIC affinity, which turns the text of a
    bare number into an INTEGER or REAL: ``2**70`` loses digits, ``1.0`` comes back as
    ``1`` and ``-0.0`` as ``0``. With TEXT affinity the JSON text is stored as written.
    """


@compiles(JSONText, "sqlite")
def _json_text_on_sqlite(type_: JSONText, compiler: Any, **kw: Any) -> str:
    return "TEXT"


def JSONValue() -> sa.JSON:  # noqa: N802 - reads like a type in table definitions
    """A JSON column whose SQL NULL stands for Python ``None``."""
    return JSONText(none_as_null=True)


# SQLite only aliases the rowid for a column declared exactly INTEGER PRIMARY KEY.
BigIntPK = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
