"""Typed reads of JSON metadata (a trace's meta_json, a centroid file's provenance): a wrong
type, a null or an out-of-range value is a ValueError naming the field, never an
AttributeError or TypeError from deep inside."""

from __future__ import annotations

import json
import math

_MISSING = object()


def as_object(value, where: str, *, parse_text: bool = True) -> dict:
    """`value` (a dict, or with `parse_text` JSON text of one) as a dict."""
    if parse_text and isinstance(value, (str, bytes)):
        try:
            value = json.loads(value or "{}")
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where} is not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be a JSON object, got {_kind(value)}")
    return value


def _kind(v) -> str:
    if v is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list", dict: "an object"}.get(type(v), type(v).__name__)


def get_int(d: dict, key: str, where: str, lo: int | None = None, hi: int | None = None, default=_MISSING) -> int:
    v = d.get(key, _MISSING)
    if v is _MISSING:
        if default is _MISSING:
            raise ValueError(f"{where} lacks {key!r}")
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{where}.{key} must be an integer, got {_kind(v)} {v!r}"[:200])
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise ValueError(f"{where}.{key} = {v} is out of range {lo}..{hi}")
    return v


def get_number(d: dict, key: str, where: str, default=_MISSING) -> float:
    v = d.get(key, _MISSING)
    if v is _MISSING:
        if default is _MISSING:
            raise ValueError(f"{where} lacks {key!r}")
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{where}.{key} must be a finite number, got {_kind(v)} {v!r}"[:200])
    return float(v)


def get_str(d: dict, key: str, where: str, default=_MISSING) -> str:
    v = d.get(key, _MISSING)
    if v is _MISSING:
        if default is _MISSING:
            raise ValueError(f"{where} lacks {key!r}")
        return default
    if not isinstance(v, str):
        raise ValueError(f"{where}.{key} must be a string, got {_kind(v)}")
    return v


def get_object(d: dict, key: str, where: str) -> dict:
    """An optional nested object: {} when absent, an error when present but not an object."""
    v = d.get(key, _MISSING)
    if v is _MISSING:
        return {}
    if not isinstance(v, dict):
        raise ValueError(f"{where}.{key} must be a JSON object, got {_kind(v)}")
    return v


def get_list(d: dict, key: str, where: str, default=_MISSING) -> list:
    v = d.get(key, _MISSING)
    if v is _MISSING:
        if default is _MISSING:
            raise ValueError(f"{where} lacks {key!r}")
        return default
    if not isinstance(v, list):
        raise ValueError(f"{where}.{key} must be a list, got {_kind(v)}")
    return v
