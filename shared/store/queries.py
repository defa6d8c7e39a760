"""The statements of sql/*.sql, loaded once: a `-- name: x` block per statement, its first
comment lines saying what it is for, and `-- fragment: f` blocks that statements share as
`{{f}}` or `{{f(argument)}}` (procrastinate keeps its queries this way; the fragments are ours,
so that a column list or a lock is written once).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path

SQL_DIR = Path(__file__).with_name("sql")  # package data, installed beside this module
_HEAD = re.compile(r"^-- (name|fragment): (\w+)(?:\((\w+)\))?\s*$")
_USE = re.compile(r"\{\{(\w+)(?:\((.*?)\))?\}\}", re.DOTALL)


@dataclass(frozen=True)
class Query:
    name: str
    doc: str  # what the statement is for: its comment lines
    sql: str  # fragments expanded
    source: str  # the file it is in


@dataclass(frozen=True)
class _Block:
    kind: str
    name: str
    param: str | None
    doc: str
    body: str
    source: str


def _blocks(text: str, source: str) -> Iterator[_Block]:
    head: re.Match[str] | None = None
    doc: list[str] = []
    body: list[str] = []

    def done() -> _Block | None:
        if head is None:
            return None
        kind, name, param = head.groups()
        return _Block(kind, name, param, " ".join(doc), "\n".join(body).strip(), source)

    for line in text.splitlines():
        found = _HEAD.match(line)
        if found:
            block = done()
            if block is not None:
                yield block
            head, doc, body = found, [], []
        elif head is not None and not body and line.startswith("--"):
            doc.append(line[2:].strip())
        elif head is not None and line.strip():
            body.append(line)
    block = done()
    if block is not None:
        yield block


def _expand(sql: str, fragments: Mapping[str, _Block], seen: tuple[str, ...] = ()) -> str:
    def use(match: re.Match[str]) -> str:
        name, argument = match.group(1), match.group(2)
        fragment = fragments.get(name)
        if fragment is None:
            raise KeyError(f"unknown SQL fragment {{{{{name}}}}}")
        if name in seen:
            raise ValueError(f"SQL fragment {name} uses itself")
        body = fragment.body
        if fragment.param is not None:
            body = body.replace("{{" + fragment.param + "}}", argument or "")
        elif argument is not None:
            raise ValueError(f"SQL fragment {name} takes no argument")
        return _expand(body, fragments, (*seen, name))

    return _USE.sub(use, sql)


class Queries(Mapping[str, Query]):
    """Every named statement; `queries.transition.sql` or `queries["transition"]`. A statement's
    fragments are expanded when it is first used (a process uses few of them)."""

    def __init__(self, blocks: dict[str, _Block], fragments: dict[str, _Block]) -> None:
        self._blocks = blocks
        self._fragments = fragments
        self._queries: dict[str, Query] = {}

    def __getitem__(self, name: str) -> Query:
        query = self._queries.get(name)
        if query is None:
            block = self._blocks[name]
            query = Query(name, block.doc, _expand(block.body, self._fragments), block.source)
            self._queries[name] = query
        return query

    def __getattr__(self, name: str) -> Query:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"no SQL statement named {name!r}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._blocks)

    def __len__(self) -> int:
        return len(self._blocks)


@cache
def load() -> Queries:
    """Read sql/*.sql once; a statement without a description or a name used twice is an error
    at import, an unknown fragment at a statement's first use (tests/integration/test_migrate.py
    expands every statement, so not in production)."""
    blocks: list[_Block] = []
    for path in sorted(SQL_DIR.glob("*.sql")):
        blocks.extend(_blocks(path.read_text("utf-8"), path.name))
    fragments = {b.name: b for b in blocks if b.kind == "fragment"}
    named: dict[str, _Block] = {}
    for block in blocks:
        if block.kind != "name":
            continue
        if block.name in named:
            raise ValueError(f"two SQL statements are named {block.name}")
        if not block.doc:
            raise ValueError(f"SQL statement {block.name} ({block.source}) says nothing of itself")
        named[block.name] = block
    return Queries(named, fragments)


Q = load()
