"""How one record becomes one line of a records file and back — exactly, or not at all.

- :func:`check_payload` — the once-only check of an opaque payload when it is
  recorded (orjson, then a plain-JSON walk with string keys).
- :func:`encode_record` — a record to one line: orjson where that is provably
  exact, else the stdlib encoder; a value that cannot be written as itself fails
  naming its episode.
- :func:`decode_line` — one line back to a record: orjson where that is
  provably exact, else ``json.loads``.
- :func:`line_key` — the capture key a line written by :func:`encode_record`
  names in its first bytes, so a restore can skip parsing records it will not keep.

Exactness means: same types all the way down (a tuple comes back as a list),
same dict key order, NaN and infinities, integers of any size.
"""

from __future__ import annotations

import json
import math
import pickle
import re
from typing import Any

import orjson

from ..protocol import ErrorCode, ProtocolError


def invalid(detail: str) -> ProtocolError:
    """``invalid_checkpoint_state`` (422): every storage, manifest or record problem."""
    return ProtocolError(ErrorCode.INVALID_CHECKPOINT_STATE, detail)


def _plain(value: Any) -> bool:
    if value is None or isinstance(value, str | bool | int | float):
        return True
    if isinstance(value, list | tuple):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return False


def check_payload(value: Any) -> None:
    """Refuse a value that is not JSON: orjson first, then a plain-JSON walk (str keys only).

    Some values orjson accepts (a datetime, a UUID, an enum, a str subclass)
    pass here and then fail the commit that tries to write them, naming the
    episode (:func:`encode_record`).
    """
    try:
        orjson.dumps(value)
        return
    except TypeError:
        pass
    try:
        if _plain(value):
            return
    except RecursionError:
        pass
    raise ValueError("checkpoint payload is not JSON")


#: orjson options of the fast path: everything orjson would otherwise turn into JSON on its own
#: (datetimes, dataclasses, subclasses of str/int/float/dict/list) goes to ``default``, which refuses.
_ORJSON_WRITE = (orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_PASSTHROUGH_DATACLASS
                 | orjson.OPT_PASSTHROUGH_SUBCLASS | orjson.OPT_APPEND_NEWLINE)
#: How many values :func:`_finite` may look at before it gives the record to the stdlib encoder.
_FINITE_WALK_LIMIT = 4096


def _refuse(value: Any) -> Any:
    raise TypeError(f"{type(value).__name__} is not plain JSON")


def _has_null(line: bytes) -> bool:
    """``b"null" in line``, cheaper when the line has few ``n`` bytes (``find`` of one byte is memchr)."""
    i = line.find(b"n")
    for _ in range(32):
        if i < 0:
            return False
        if line.startswith(b"null", i):
            return True
        i = line.find(b"n", i + 1)
    return i >= 0 and line.find(b"null", i) >= 0


def _finite(value: Any) -> bool:
    """True when no float in ``value`` is NaN or infinite; False when one is, or proving it costs too much.

    ``value`` has only exact JSON types and an orjson encoding that holds
    ``null``. A container is searched only when its own orjson encoding holds
    ``null``: orjson writes every non-finite float as ``null``, so one without
    it has none.
    """
    stack = [value]
    seen = 0
    while stack:
        current = stack.pop()
        children = current.values() if type(current) is dict else current
        for child in children:
            seen += 1
            if seen > _FINITE_WALK_LIMIT:
                return False
            kind = type(child)
            if kind is float:
                if not math.isfinite(child):
                    return False
            elif kind is dict or kind is list or kind is tuple:
                if _has_null(orjson.dumps(child)):
                    stack.append(child)
    return True


class _ExactTypes(pickle.Pickler):
    """A type check at C speed: pickling calls :meth:`reducer_override` for every object that is
    not ``None``, a ``bool`` or of the exact type ``int``, ``float``, ``str``, ``list``, ``tuple``,
    ``dict`` (or ``bytes``, ``bytearray``, ``set``, ``frozenset``, which orjson and ``json`` refuse),
    keys included, and this one refuses them all. The pickle itself is thrown away as it is made
    (in 64 KB frames), so it costs no large allocation."""

    def reducer_override(self, obj: Any) -> Any:
        raise TypeError(f"it holds a {type(obj).__module__}.{type(obj).__qualname__}, "
                        "which JSON cannot restore as itself")


class _Discard:
    __slots__ = ()

    def write(self, data: bytes) -> int:
        return len(data)


_DISCARD = _Discard()


def _check_types(value: Any) -> None:
    _ExactTypes(_DISCARD, protocol=4).dump(value)


def _non_str_key(value: Any) -> str | None:
    """The type of the first dict key in ``value`` that is not a str, if any (``json.dumps``
    would write it as a string). Each container is looked at once, so a cycle ends the walk."""
    stack = [value]
    seen: set[int] = set()
    while stack:
        current = stack.pop()
        kind = type(current)
        if kind is dict or kind is list or kind is tuple:
            if id(current) in seen:
                continue
            seen.add(id(current))
        if kind is dict:
            for key in current:
                if type(key) is not str:
                    return type(key).__name__
            stack.extend(current.values())
        elif kind is list or kind is tuple:
            stack.extend(current)
    return None


def encode_record(record: dict[str, Any], episode: str) -> bytes:
    """One line of the records file, or ``invalid_checkpoint_state`` naming the episode.

    The line reads back (:func:`read_records`) as ``record`` exactly — same
    types all the way down (a tuple becomes a list), same dict key order, NaN
    and infinities, integers of any size — or the record is refused. Why the
    orjson fast path is exact:

    1. :class:`_ExactTypes` lets through only values made of ``None``, ``bool``
       and *exact* ``int``, ``float``, ``str``, ``list``, ``tuple``, ``dict``
       (and bytes, bytearrays and sets, which orjson and ``json`` both refuse).
       So no enum, UUID, ``orjson.Fragment``, datetime, dataclass or subclass
       of a builtin — which orjson writes natively, or ``json`` writes as their
       base type, reading back as something else — gets past it: those fail
       the commit. It costs about what ``orjson.dumps`` costs (10 ns a value).
    2. Given exact types, ``orjson.dumps`` refuses everything it cannot write as
       itself (a non-str key, an integer beyond 64 bits, nesting deeper than
       255, a cycle, a str with a lone surrogate) and writes the rest so that
       ``json.loads`` and :func:`_decode_line` read it back exactly (floats in
       their shortest round-trip form, dict keys in order), except NaN and
       ±Infinity, which it writes as ``null``.
    3. So a line without ``null`` is exact; a line with ``null`` is exact when
       :func:`_finite` proves no float is non-finite (only the parts whose
       encoding holds ``null`` are searched).

    Everything else goes to ``json.dumps(ensure_ascii=False)`` (exact for exact
    types with str keys: integers of any size, NaN and ±Infinity as literals
    that ``json.loads`` reads back), after a check for non-str keys, which
    ``json.dumps`` would silently turn into strings.
    """
    try:
        _check_types(record)
        try:
            line = orjson.dumps(record, default=_refuse, option=_ORJSON_WRITE)
        except TypeError:  # orjson.JSONEncodeError too
            key = _non_str_key(record)
            if key is not None:
                raise TypeError(f"it holds a {key} dict key, which JSON would turn into a string") from None
        else:
            if not _has_null(line) or _finite(record):
                return line
        return (json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n").encode()
    except (TypeError, ValueError, RecursionError, pickle.PicklingError) as exc:
        raise invalid(f"checkpoint record of episode {episode!r} is not JSON: {exc}") from None


# -- reading --------------------------------------------------------------------------------------

#: Digits 1-9 become 0, every other byte stays: a run of 19 zeros afterwards is a run of 19 digits.
_DIGITS_TO_ZERO = bytes.maketrans(b"123456789", b"000000000")
_LONG_RUN = b"0" * 19


def _long_number(line: bytes) -> bool:
    """Whether ``line`` has a run of 19+ digits (``re`` ``[0-9]{19}``, at a tenth of its cost)."""
    return _LONG_RUN in line.translate(_DIGITS_TO_ZERO)


def decode_line(line: bytes, number: int, name: str) -> Any:
    """Parse one records line exactly: orjson when that is provably exact, else the stdlib.

    orjson refuses NaN and Infinity tokens (those lines go to ``json.loads``)
    and reads an integer beyond 64 bits as a float; otherwise it reads what
    ``json.loads`` reads. Its value is kept when either

    - orjson writes it back as exactly ``line`` (what :func:`encode_record`'s
      fast path writes): a float read from an integer literal would be written
      back with a ``.`` or an exponent, so no integer was widened; or
    - ``line`` has no run of 19 or more digits, so it has no integer beyond
      64 bits (a legacy or stdlib-written line).

    Everything else goes through ``json.loads``.
    """
    try:
        value = orjson.loads(line)
    except orjson.JSONDecodeError:
        pass
    else:
        try:
            if orjson.dumps(value, option=orjson.OPT_APPEND_NEWLINE) == line:
                return value
        except TypeError:  # nested deeper than orjson writes
            pass
        if not _long_number(line):
            return value
    try:
        return json.loads(line)
    except (ValueError, RecursionError):
        raise invalid(f"line {number} of {name} is not JSON") from None


#: The first bytes of a line :func:`encode_record` writes for a record whose first field is its
#: ``episode_id`` (every participant kind here writes it first): compact JSON, the rollout id
#: limited to ``ID_PATTERN`` characters (so no quote or escape can occur inside it).
_KEY_PREFIX = re.compile(rb'\{"episode_id":\{"rollout_id":"([A-Za-z0-9][A-Za-z0-9._-]*)","attempt":(0|[1-9][0-9]{0,17})\}')


def line_key(line: bytes) -> str | None:
    """The capture key a records line names in its prefix, or ``None`` when it has another form.

    Exact for what :func:`encode_record` writes: the prefix is a complete JSON object, so the
    record's ``episode_id`` is that object (a record has no duplicate keys). A restore verifies the
    whole file's digest against its manifest, so a line skipped on its key alone is still checked.
    """
    match = _KEY_PREFIX.match(line)
    if match is None:
        return None
    rollout_id, attempt = match.group(1).decode(), int(match.group(2))
    return rollout_id if attempt == 0 else f"{rollout_id}-a{attempt}"
