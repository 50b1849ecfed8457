"""Validated reading of JSON objects: one clear error naming the field.

Role: every mplan file (cluster spec, profile) is validated on load; this module turns a parsed
JSON object into typed values and, on the first wrong field, raises one error of the caller's class
whose message names the file and the dotted field path, e.g.
``cluster.json: links.inter_node.bandwidth_Bps must be a positive number, got "fast"``.
Input: a parsed JSON value, the file name, the error class. Output: typed Python values.
Invariants: unknown keys are errors too (a typo must not be silently ignored); booleans are never
accepted as numbers, nor NaN, infinities or ints beyond float range; a file that is not UTF-8, not
JSON or nested too deeply is one error naming the file, and an integer with more digits than Python
parses loads as a ``HugeNumber`` that every typed read refuses naming its field
(``tests/test_fuzz_inputs.py`` fuzzes every reader built on this module).
"""
from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from typing import Any


def _show(value: Any) -> str:
    try:
        text = json.dumps(value) if _is_json(value) else repr(value)
    except ValueError:  # an int with more digits than Python converts to text
        text = f"an integer of about {value.bit_length() * 3 // 10} digits" if isinstance(value, int) \
            else f"a {type(value).__name__}"
    return text if len(text) <= 60 else text[:57] + "..."


def _is_json(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        return False
    return True


class HugeNumber:
    """A JSON integer with more digits than Python's int() converts (``sys.get_int_max_str_digits``):
    kept as its text so the reader that wanted a number names the field; no reader accepts it."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return f"<an integer of {len(self.text.lstrip('-'))} digits>"


def _parse_int(text: str) -> int | HugeNumber:
    limit = sys.get_int_max_str_digits()
    return HugeNumber(text) if limit and len(text.lstrip("-")) > limit else int(text)


def is_finite_number(value: Any) -> bool:
    """A JSON number (not a bool) that is finite as a float (an int beyond float range is not)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


class FieldReader:
    """A JSON object at a dotted path inside a file, read one typed field at a time."""

    __slots__ = ("_obj", "_file", "_path", "_error", "_seen")

    def __init__(self, obj: Any, *, file: str, path: str, error: type[Exception]) -> None:
        self._file, self._path, self._error = file, path, error
        if not isinstance(obj, dict):
            raise self._fail(path or "the top level", "must be a JSON object", obj)
        self._obj: dict[str, Any] = obj
        self._seen: set[str] = set()

    def _name(self, key: str) -> str:
        return f"{self._path}.{key}" if self._path else key

    def _fail(self, name: str, what: str, value: Any) -> Exception:
        return self._error(f"{self._file}: {name} {what}, got {_show(value)}")

    def error(self, key: str, what: str) -> Exception:
        """An error of the reader's class for ``key``, for checks made by the caller."""
        return self._fail(self._name(key), what, self._obj.get(key))

    def has(self, key: str) -> bool:
        """Whether ``key`` is present and not null (an optional field); marks it as read."""
        self._seen.add(key)
        return key in self._obj and self._obj[key] is not None

    def _get(self, key: str) -> Any:
        self._seen.add(key)
        if key not in self._obj:
            raise self._error(f"{self._file}: {self._name(key)} is missing")
        return self._obj[key]

    def number(self, key: str, *, minimum: float = 0.0, allow_equal: bool = False) -> float:
        """A finite number above ``minimum`` (or equal to it with ``allow_equal``)."""
        value = self._get(key)
        ok = is_finite_number(value) and (value >= minimum if allow_equal else value > minimum)
        if not ok:
            wanted = "a non-negative number" if minimum == 0 and allow_equal else "a positive number" \
                if minimum == 0 else f"a number of at least {minimum:g}" if allow_equal else f"a number above {minimum:g}"
            raise self._fail(self._name(key), f"must be {wanted}", value)
        return float(value)

    def fraction(self, key: str) -> float:
        """A number in (0, 1]."""
        value = self._get(key)
        if not (is_finite_number(value) and 0 < value <= 1):
            raise self._fail(self._name(key), "must be a number in (0, 1]", value)
        return float(value)

    def integer(self, key: str, *, minimum: int = 1) -> int:
        value = self._get(key)
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= minimum):
            raise self._fail(self._name(key), f"must be an integer >= {minimum}", value)
        return value

    def string(self, key: str, *, choices: Sequence[str] | None = None) -> str:
        value = self._get(key)
        if not isinstance(value, str) or (choices is not None and value not in choices):
            what = f"must be one of {', '.join(repr(c) for c in choices)}" if choices else "must be a string"
            raise self._fail(self._name(key), what, value)
        return value

    def boolean(self, key: str) -> bool:
        value = self._get(key)
        if not isinstance(value, bool):
            raise self._fail(self._name(key), "must be true or false", value)
        return value

    def obj(self, key: str) -> FieldReader:
        return FieldReader(self._get(key), file=self._file, path=self._name(key), error=self._error)

    def raw(self, key: str) -> Any:
        """The value as parsed, for a caller that decides its type (e.g. object or path)."""
        return self._get(key)

    def objects(self, key: str) -> list[FieldReader]:
        """A JSON array of objects, each as a reader at ``key[i]``."""
        value = self._get(key)
        if not isinstance(value, list):
            raise self._fail(self._name(key), "must be a JSON array", value)
        return [FieldReader(item, file=self._file, path=f"{self._name(key)}[{i}]", error=self._error)
                for i, item in enumerate(value)]

    def finish(self) -> None:
        """Raise if the object holds a key nobody read (a typo or a field of another version)."""
        unknown = sorted(set(self._obj) - self._seen)
        if unknown:
            raise self._fail(self._name(unknown[0]), "is not a known field", self._obj[unknown[0]])


def load_json_file(path: str, error: type[Exception]) -> Any:
    """Parse ``path`` as JSON, turning I/O, encoding and syntax failures into ``error`` naming the file."""
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except OSError as exc:
        raise error(f"{path}: cannot read: {exc.strerror or exc}") from None
    except ValueError as exc:  # a path holding a NUL byte
        raise error(f"{path!r}: cannot read: {exc}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{path}: not valid JSON: not UTF-8 text (byte {exc.start} is {data[exc.start]:#04x})") from None
    try:
        return json.loads(text, parse_int=_parse_int)
    except json.JSONDecodeError as exc:
        raise error(f"{path}: not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise error(f"{path}: not valid JSON: arrays or objects nested too deeply") from None
