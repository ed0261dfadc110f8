"""Field checks for record bodies read from the network: every field of a signed record or a data-plane header
goes through one of these, so a bad value is one :class:`ProtocolError` naming the field, never another error.

Messages show at most a bounded preview of a hostile value (:func:`hlbp.protocol.untrusted.preview`).
"""

from __future__ import annotations

import math
import re
from typing import Any

from hlbp.protocol.errors import ProtocolError
from hlbp.protocol.untrusted import preview

_MISSING = object()


def _field(body: dict[str, Any], name: str, default: Any) -> Any:
    value = body.get(name, default)
    if value is _MISSING:
        raise ProtocolError(f"record field {name!r} is missing")
    return value


def _int(body: dict[str, Any], name: str, lo: int, hi: int, default: Any = _MISSING) -> int:
    value = _field(body, name, default)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ProtocolError(f"record field {name!r} must be an integer in [{lo}, {hi}], got {preview(value)}")
    return value


def _opt_int(body: dict[str, Any], name: str, lo: int, hi: int) -> int | None:
    return None if body.get(name) is None else _int(body, name, lo, hi)


def _float(body: dict[str, Any], name: str, lo: float, hi: float, default: Any = _MISSING) -> float:
    value = _field(body, name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProtocolError(f"record field {name!r} must be a number, got {type(value).__name__}")
    value = float(value)
    if not (math.isfinite(value) and lo <= value <= hi):
        raise ProtocolError(f"record field {name!r} must be finite and in [{lo}, {hi}], got {value}")
    return value


def _bool(body: dict[str, Any], name: str, default: Any = _MISSING) -> bool:
    value = _field(body, name, default)
    if not isinstance(value, bool):
        raise ProtocolError(f"record field {name!r} must be true or false, got {type(value).__name__}")
    return value


def _str(body: dict[str, Any], name: str, max_len: int, default: Any = _MISSING,
         pattern: re.Pattern[str] | None = None, choices: tuple[str, ...] | None = None) -> str:
    value = _field(body, name, default)
    if not isinstance(value, str) or len(value) > max_len:
        raise ProtocolError(f"record field {name!r} must be a string of at most {max_len} characters")
    if pattern is not None and not pattern.fullmatch(value):  # fullmatch: "$" would let a trailing "\n" pass
        raise ProtocolError(f"record field {name!r} has an invalid value {value[:40]!r}")
    if choices is not None and value not in choices:
        raise ProtocolError(f"record field {name!r} must be one of {', '.join(choices)}, got {value[:40]!r}")
    return value


def _str_list(body: dict[str, Any], name: str, max_items: int, max_len: int,
              pattern: re.Pattern[str] | None = None) -> tuple[str, ...]:
    value = body.get(name, [])
    if not isinstance(value, list) or len(value) > max_items:
        raise ProtocolError(f"record field {name!r} must be a list of at most {max_items} strings")
    return tuple(_str({"item": item}, "item", max_len, pattern=pattern) for item in value)
