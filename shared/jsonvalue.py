"""JSON from outside, made safe (pure): parsed strictly on the way in, cleaned on the way out.

What sked reads from producers (submissions) is refused whole with a reason naming the place
when Postgres could not store it or Python could not walk it: text that is not UTF-8, NaN and
Infinity, NUL characters and lone surrogates in strings, nesting deeper than MAX_DEPTH. What
tasks hand back (results, errors, log tails) is cleaned instead, because a task's outcome must
always be recordable: NUL and lone surrogates escaped, text cut with a marker.
"""

from __future__ import annotations

import json
from typing import Any

MAX_DEPTH = 64  # levels of arrays and objects; a task spec needs a handful
CUT = " …[cut]"


class Unsafe(ValueError):
    """JSON that sked will not take; the message says what and where."""


def _refuse_constant(name: str) -> Any:
    raise Unsafe(f"{name} is not a JSON number")


def parse(body: bytes | str) -> Any:
    """Strict JSON: UTF-8, no NaN or Infinity, no NUL or lone surrogate in any string, at most
    MAX_DEPTH levels deep. Raises Unsafe (a ValueError) saying what is wrong."""
    try:
        text = body.decode("utf-8") if isinstance(body, bytes) else body
    except UnicodeDecodeError as exc:
        raise Unsafe(f"malformed JSON: not UTF-8: {exc}") from None
    try:
        value = json.loads(text, parse_constant=_refuse_constant)
    except Unsafe:
        raise
    except RecursionError:
        raise Unsafe(f"nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as exc:  # JSONDecodeError, and integers past Python's digit limit
        raise Unsafe(f"malformed JSON: {exc}") from None
    why = problem(value)
    if why is not None:
        raise Unsafe(why)
    return value


def _bad_text(text: str) -> str | None:
    if "\x00" in text:
        return "a NUL character"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "a lone surrogate (not encodable as UTF-8)"
    return None


def problem(value: Any) -> str | None:
    """Why Postgres could not store `value` as jsonb, naming where; None if it can."""
    # Iterative: no depth of nesting can exhaust the interpreter's stack.
    todo: list[tuple[Any, str, int]] = [(value, "", 0)]
    while todo:
        item, where, depth = todo.pop()
        if depth > MAX_DEPTH:
            return f"nested deeper than {MAX_DEPTH} levels (at {where or 'the top'})"
        if isinstance(item, str):
            bad = _bad_text(item)
            if bad:
                return f"{where or 'the value'} holds {bad}"
        elif isinstance(item, dict):
            for key, sub in item.items():
                bad = _bad_text(key) if isinstance(key, str) else "a key that is not a string"
                if bad:
                    return f"a key in {where or 'the top object'} holds {bad}"
                todo.append((sub, f"{where}.{key}" if where else key, depth + 1))
        elif isinstance(item, list):
            todo.extend((sub, f"{where}[{i}]", depth + 1) for i, sub in enumerate(item))
        elif isinstance(item, float) and (item != item or abs(item) == float("inf")):
            return f"{where or 'the value'} is {item!r}, not a JSON number"
    return None


def clean_text(text: str) -> str:
    """`text` as Postgres can store it: NUL becomes the two characters `\\0`, and a lone
    surrogate its `\\udXXX` escape. Everything else is kept."""
    if "\x00" in text:
        text = text.replace("\x00", "\\0")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def clip(text: str, limit: int, *, keep_end: bool = False) -> str:
    """At most `limit` characters, with a marker where it was cut (at the start with
    `keep_end`, as for the tail of a log)."""
    if len(text) <= limit:
        return text
    if keep_end:
        return CUT.strip() + " " + text[-(limit - len(CUT)) :]
    return text[: limit - len(CUT)] + CUT


def clean(value: Any) -> Any:
    """A copy of `value` that Postgres's jsonb takes: strings and keys cleaned (`clean_text`).
    Raises ValueError for what cannot be made JSON without changing its meaning: NaN and
    Infinity, values that are not JSON types, nesting deeper than MAX_DEPTH."""
    root: list[Any] = [None]
    todo: list[tuple[Any, Any, Any, int]] = [(value, root, 0, 0)]
    while todo:
        item, parent, key, depth = todo.pop()
        if depth > MAX_DEPTH:
            raise ValueError(f"nested deeper than {MAX_DEPTH} levels")
        if isinstance(item, str):
            parent[key] = clean_text(item)
        elif item is None or isinstance(item, bool | int):
            parent[key] = item
        elif isinstance(item, float):
            if item != item or abs(item) == float("inf"):
                raise ValueError(f"{item!r} is not a JSON number")
            parent[key] = item
        elif isinstance(item, dict):
            obj: dict[str, Any] = {}
            parent[key] = obj
            for k, v in item.items():
                if not isinstance(k, str):
                    raise ValueError(f"a JSON object key must be a string, not {type(k).__name__}")
                obj[clean_text(k)] = None
                todo.append((v, obj, clean_text(k), depth + 1))
        elif isinstance(item, list | tuple):
            arr: list[Any] = [None] * len(item)
            parent[key] = arr
            todo.extend((v, arr, i, depth + 1) for i, v in enumerate(item))
        else:
            raise ValueError(f"{type(item).__name__} is not a JSON type")
    return root[0]
