"""One synchronous read through libpq, the C client Postgres ships: the CLI's `sked status`.

Why a binding of our own (ctypes, a handful of calls): for a command that makes one query
and exits, the Python clients cost more to import than the whole answer should take. Measured
here: asyncpg needs asyncio, ~60 ms of imports together; psycopg ~140 ms; pg8000 ~90 ms;
ctypes and loading libpq ~8 ms. libpq keeps doing what must not be written again — the
connection URL, authentication (SCRAM, md5, ...), TLS, the wire protocol — and this module
only passes a query with text parameters and takes one text value back. Where libpq cannot be
loaded, `Unavailable` is raised and the caller reads through asyncpg instead.
"""

from __future__ import annotations

import ctypes
import select
import time
from collections.abc import Sequence

from shared.errors import SkedError, postgres_refused
from shared.redact import masked

CONNECTION_OK = 0
PGRES_TUPLES_OK = 2
# A server that takes the connection and then says nothing (frozen, a half-open path, a stuck
# proxy) held `sked status` for ever: libpq waits without bound unless told
CONNECT_TIMEOUT_S = 10  # libpq's connect_timeout, unless the URL sets its own
QUERY_TIMEOUT_S = 30.0
PG_DIAG_SQLSTATE = ord("C")  # PQresultErrorField's codes (postgres_ext.h)
PG_DIAG_MESSAGE_PRIMARY = ord("M")
SEARCH_PATH = b"-c search_path=public"  # shared.store.db.SCHEMA
_NAMES = ("libpq.so.5", "libpq.5.dylib", "libpq.so", "libpq.dylib")


class Unavailable(Exception):
    """libpq is not installed here (or not loadable)."""


class NotConnected(SkedError):
    """libpq could not connect (or would not take the URL): the caller may try asyncpg, which
    reads a few URL parameters libpq does not, and words its own error if it fails too."""


_lib: ctypes.CDLL | None = None


def _load() -> ctypes.CDLL:
    global _lib
    if _lib is not None:
        return _lib
    for name in _NAMES:
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError:
            continue
    else:
        raise Unavailable("libpq is not installed")
    p, s, i = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int
    signatures = {
        "PQconnectdbParams": (p, [ctypes.POINTER(s), ctypes.POINTER(s), i]),
        "PQstatus": (i, [p]),
        "PQerrorMessage": (s, [p]),
        "PQsendQueryParams": (i, [p, s, i, p, ctypes.POINTER(s), p, p, i]),
        "PQsocket": (i, [p]),
        "PQconsumeInput": (i, [p]),
        "PQisBusy": (i, [p]),
        "PQgetResult": (p, [p]),
        "PQresultStatus": (i, [p]),
        "PQresultErrorMessage": (s, [p]),
        "PQresultErrorField": (s, [p, i]),
        "PQntuples": (i, [p]),
        "PQgetisnull": (i, [p, i, i]),
        "PQgetvalue": (s, [p, i, i]),
        "PQclear": (None, [p]),
        "PQfinish": (None, [p]),
    }
    for fn, (restype, argtypes) in signatures.items():
        func = getattr(lib, fn)
        func.restype = restype
        func.argtypes = argtypes
    _lib = lib
    return lib


def _message(raw: bytes | None) -> str:
    return (raw or b"").decode("utf-8", "replace").strip() or "unknown error"


def fetch_text(dsn: str, sql: str, params: Sequence[str]) -> str | None:
    """The first column of the first row `sql` returns, as text; None if there is no row or
    the value is NULL. Raises Unavailable without libpq, NotConnected (with libpq's message)
    if it cannot connect, SkedError if the query fails."""
    lib = _load()
    # options first: a URL's own (dbname, expanded) replace it; else sked's schema is pinned,
    # as on every asyncpg session (shared.store.db.pinned_dsn)
    try:
        url = dsn.encode()
    except UnicodeEncodeError:  # a byte that is not UTF-8 in the variable
        raise NotConnected("cannot connect to Postgres: the URL is not UTF-8") from None
    timeout = str(CONNECT_TIMEOUT_S).encode()
    keys = (ctypes.c_char_p * 5)(
        b"options", b"connect_timeout", b"dbname", b"client_encoding", None
    )
    values = (ctypes.c_char_p * 5)(SEARCH_PATH, timeout, url, b"UTF8", None)
    conn = lib.PQconnectdbParams(keys, values, 1)  # 1: dbname may be a URL, expanded
    if not conn:
        raise NotConnected("cannot connect to Postgres: libpq is out of memory")
    try:
        if lib.PQstatus(conn) != CONNECTION_OK:
            why = _message(lib.PQerrorMessage(conn))
            raise NotConnected(f"cannot connect to Postgres: {masked(why)}")  # it quotes URLs
        result = _answer(lib, conn, sql, params)
        try:
            if lib.PQresultStatus(result) != PGRES_TUPLES_OK:
                said = lib.PQresultErrorField(result, PG_DIAG_MESSAGE_PRIMARY)
                if said is None:  # libpq's own error (the connection lost), not the server's
                    why = _message(lib.PQresultErrorMessage(result))
                    raise SkedError(f"lost the connection to Postgres: {masked(why)}")
                code = lib.PQresultErrorField(result, PG_DIAG_SQLSTATE)
                sqlstate = code.decode() if code else None
                raise SkedError(f"Postgres: {postgres_refused(_message(said), sqlstate)}")
            if lib.PQntuples(result) == 0 or lib.PQgetisnull(result, 0, 0):
                return None
            value: bytes = lib.PQgetvalue(result, 0, 0)
            return value.decode("utf-8")
        finally:
            lib.PQclear(result)
    finally:
        lib.PQfinish(conn)


def _answer(lib: ctypes.CDLL, conn: int, sql: str, params: Sequence[str]) -> int:
    """The query's result, waited for within QUERY_TIMEOUT_S (PQexecParams waits for ever)."""
    args = (ctypes.c_char_p * max(len(params), 1))(*(v.encode() for v in params))
    if not lib.PQsendQueryParams(conn, sql.encode(), len(params), None, args, None, None, 0):
        raise SkedError(f"query failed: {masked(_message(lib.PQerrorMessage(conn)))}")
    deadline = time.monotonic() + QUERY_TIMEOUT_S
    while lib.PQisBusy(conn):
        left = deadline - time.monotonic()
        if left <= 0:
            raise SkedError(f"Postgres did not answer within {QUERY_TIMEOUT_S:g} s")
        select.select([lib.PQsocket(conn)], [], [], left)
        if not lib.PQconsumeInput(conn):
            why = masked(_message(lib.PQerrorMessage(conn)))
            raise SkedError(f"lost the connection to Postgres: {why}")
    result: int | None = lib.PQgetResult(conn)
    if not result:
        raise SkedError(f"query failed: {masked(_message(lib.PQerrorMessage(conn)))}")
    return result  # what follows it (the end of the answer) is left to PQfinish
