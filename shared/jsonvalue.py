"""JSON from outside, made safe (pure): parsed strictly on the way in, cleaned on the way out.

What sked reads from producers (submissions) is refused whole with a reason naming the place
when Postgres could not store it or Python could not walk it: text that is not UTF-8, NaN and
Infinity, NUL characters and lone surrogates in strings, nesting deeper than MAX_DEPTH. What
tasks hand back (results, errors, log tails) is cleaned instead, because a task's outcome must
always be recordable: NUL and lone surrogates escaped, text cut with a marker.
"""

from __future__ import annotations

import json
import re
from itertools import accumulate
from typing import Any

from shared.errors import InvalidSpec

MAX_DEPTH = 64  # levels of arrays and objects; a task spec needs a handful
# A result's JSON once cleaned (json.dumps of `clean`'s copy); more fails the attempt. Here, not
# in shared.outcome, so that a handler worker can judge its result without importing the models.
MAX_RESULT_BYTES = 1024 * 1024
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
    infinite = False

    def finite(number: str) -> float:
        # a literal past float's range (1e400) parses as inf: only the walk below names it
        nonlocal infinite
        value = float(number)
        if value in _INFINITE:
            infinite = True
        return value

    try:
        value = json.loads(text, parse_constant=_refuse_constant, parse_float=finite)
    except Unsafe:
        raise
    except RecursionError:
        raise Unsafe(f"nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as exc:  # JSONDecodeError, and integers past Python's digit limit
        raise Unsafe(f"malformed JSON: {exc}") from None
    if infinite or isinstance(body, str) or _may_be_unsafe(body):
        why = problem(value)
        if why is not None:
            raise Unsafe(why)
    return value


def refuse_unsafe(body: bytes) -> None:
    """Raises Unsafe if JSON this process rendered (UTF-8 and well formed: a model's dump)
    holds what `parse` refuses. A producer checks its message with it before sending: what
    intake would dead-letter is refused at the caller, and the cost is a scan of the bytes."""
    if _may_be_unsafe(body):
        parse(body)


# What `problem` looks for can only come from a few places in JSON text that decoded from
# UTF-8 and parsed: a NUL or a lone surrogate only from a \u escape (the decoder refuses raw
# control characters, and UTF-8 cannot carry a surrogate), an infinite float only from a
# literal out of range (seen as it is parsed), and nesting only from brackets. A text with
# none of these, nested at most MAX_DEPTH deep, is safe without walking the value — which
# cost a batch of submissions ~15 µs a task, most of intake's check (docs/performance.md).
# Any doubt falls back to the walk, which names the place.
_INFINITE = (float("inf"), float("-inf"))
_RISKY_ESCAPE = re.compile(rb"\\u(?:0000|[dD][89a-fA-F])")
_NOT_STRUCTURE = bytes(c for c in range(256) if c not in b'[]{}"\\')
_OPENS = frozenset(b"[{")


def _may_be_unsafe(body: bytes) -> bool:
    """False only if `problem` would find nothing in the value parsed from `body` (UTF-8,
    valid JSON)."""
    if _RISKY_ESCAPE.search(body):
        return True
    if body.count(b"[") + body.count(b"{") <= MAX_DEPTH:
        return False
    # The nesting, from the brackets outside strings. Kept: brackets, quotes, backslashes.
    # Without a backslash quotes alternate open, close; dropping adjacent pairs left to right
    # then drops every quote only if no string holds a bracket (the first quote can only pair
    # with the second, so the first string holds none; and so on). Otherwise: the walk.
    marks = body.translate(None, _NOT_STRUCTURE)
    if b"\\" in marks:
        return True
    brackets = marks.replace(b'""', b"")
    if b'"' in brackets:
        return True
    depths = accumulate(1 if c in _OPENS else -1 for c in brackets)
    return max(depths, default=0) > MAX_DEPTH


MAX_NOTE = 4096  # characters of an operator's reason or name: a sentence, not a document


def note(field: str, text: str) -> str:
    """An operator's words (a reason, who acted) as a state change records them: `text`, or
    InvalidSpec naming `field` if Postgres could not store it or it is longer than a note."""
    if not isinstance(text, str):
        raise InvalidSpec(f"{field} must be text, not {type(text).__name__}")
    bad = bad_text(text)
    if bad is None and len(text) > MAX_NOTE:
        bad = f"{len(text)} characters (at most {MAX_NOTE})"
    if bad is not None:
        raise InvalidSpec(f"{field} holds {bad}")
    return text


def bad_text(text: str) -> str | None:
    """What in `text` Postgres cannot store as text or in jsonb; None if nothing."""
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
            bad = bad_text(item)
            if bad:
                return f"{where or 'the value'} holds {bad}"
        elif isinstance(item, dict):
            for key, sub in item.items():
                bad = bad_text(key) if isinstance(key, str) else "a key that is not a string"
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
                ck = clean_text(k)
                if ck in obj:  # two keys one once escaped: keeping either drops a value
                    other = next(o for o in item if o != k and clean_text(o) == ck)
                    raise ValueError(f"keys {other!r} and {k!r} are the same once escaped ({ck!r})")
                obj[ck] = None
                todo.append((v, obj, ck, depth + 1))
        elif isinstance(item, list | tuple):
            arr: list[Any] = [None] * len(item)
            parent[key] = arr
            todo.extend((v, arr, i, depth + 1) for i, v in enumerate(item))
        else:
            raise ValueError(f"{type(item).__name__} is not a JSON type")
    return root[0]


def cleaned_size_floor(text: str | bytes) -> int:
    """At most the size of `clean(value)`'s JSON, given `text`, the json.dumps of `value`:
    cleaning shortens only a NUL (`\\u0000`, 6 bytes, becomes `\\0`, 3) and lengthens a lone
    surrogate. A count over the text, where walking the value costs ~2 µs an element."""
    # an escaped backslash before "u0000" counts too: a lower floor, still a floor
    if isinstance(text, bytes):
        return len(text) - 3 * text.count(b"\\u0000")
    return len(text) - 3 * text.count("\\u0000")


def few(value: Any, limit: int) -> bool:
    """Whether `value` holds at most `limit` values, itself and those nested in it (what
    `clean` walks), counted only as far as `limit`."""
    todo, seen = [value], 1
    while todo:
        item = todo.pop()
        if isinstance(item, dict):
            item = item.values()
        elif not isinstance(item, list | tuple):
            continue
        seen += len(item)
        if seen > limit:
            return False
        todo.extend(item)
    return True


def same_json(a: Any, b: Any) -> bool:
    """Whether two parsed JSON values are the same JSON, numbers compared by value: Postgres's
    jsonb keeps a number as an exact decimal, so a float such as 1e23 reads back as the
    integer 10**23, which Python's == tells from the float it was. Iterative, as `storable`."""
    todo = [(a, b)]
    while todo:
        x, y = todo.pop()
        if isinstance(x, bool) or isinstance(y, bool):  # true is not 1 in JSON
            if x is not y:
                return False
        elif isinstance(x, int | float) and isinstance(y, int | float):
            if x != y and not _same_number(x, y):
                return False
        elif isinstance(x, dict) and isinstance(y, dict):
            if x.keys() != y.keys():
                return False
            todo.extend((v, y[k]) for k, v in x.items())
        elif isinstance(x, list) and isinstance(y, list):
            if len(x) != len(y):
                return False
            todo.extend(zip(x, y, strict=True))
        elif type(x) is not type(y) or x != y:
            return False
    return True


def _same_number(x: float, y: float) -> bool:
    try:
        return float(x) == float(y)
    except OverflowError:  # an integer past any float: only an equal integer is the same
        return False
