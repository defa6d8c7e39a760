"""One exception root for sked, and the specific errors callers are expected to handle."""

from __future__ import annotations

import sys
from typing import Any


class SkedError(Exception):
    """Root of every error sked raises on purpose."""


class UnknownState(SkedError, ValueError):
    def __init__(self, value: object, known: list[str]) -> None:
        super().__init__(f"unknown state {value!r}; known states: {', '.join(known)}")
        self.value = value


class IllegalTransition(SkedError):
    """The FSM has no rule for this move, or the rule's guard refuses it. Nothing was written."""

    def __init__(self, from_state: Any, to_state: Any, why: str = "") -> None:
        detail = f": {why}" if why else ""
        super().__init__(f"illegal transition {from_state} -> {to_state}{detail}")
        self.from_state = from_state
        self.to_state = to_state


class StaleWrite(SkedError):
    """A compare-and-swap lost: the task moved on since the caller read it."""


class NotAllowed(SkedError):
    """The task's state does not allow the action (terminal, or already so): HTTP 409."""


class NotFound(SkedError, LookupError):
    pass


class Purged(NotFound):
    """The task or workflow was there, and retention deleted it (SKED_RETENTION_DAYS): a
    wait for it ends with this. Told for one retention after the deletion; later an id
    retention deleted reads as one never admitted."""


def missing(what: str, ident: object, purged_at: object | None) -> NotFound:
    """The error for a task or workflow id with no row: Purged naming when, if retention
    deleted it (and remembers), else NotFound."""
    if purged_at is None:
        return NotFound(f"no {what} {ident}")
    return Purged(f"{what} {ident} was deleted by retention at {purged_at}")


class InvalidSettings(SkedError, ValueError):
    """SKED_* variables refused: each named with why, never with its value."""


class InvalidSpec(SkedError, ValueError):
    """Input that fails validation; the message says which field and why."""


# undefined_table, undefined_function: what a database sked never migrated answers
_NOT_MIGRATED = frozenset({"42P01", "42883"})


def postgres_refused(message: str, sqlstate: str | None) -> str:
    """Postgres's refusal as an operator should read it: its message's first line, and for a
    table or function that is not there, where they come from."""
    first = message.strip().splitlines()[0] if message.strip() else "unknown error"
    if sqlstate in _NOT_MIGRATED:
        return f"{first} (is the database migrated? `sked migrate` creates its tables)"
    return first


def one_line(exc: BaseException) -> str:
    """`ValueError: bad`, on one line: for reasons that go into events, logs and headers."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# The servers' refusals, looked up in sys.modules: only code that used a server's client
# library can have raised its errors, and the CLI imports none it does not need.


def postgres_said(exc: BaseException) -> str | None:
    """What Postgres answered, when `exc` is its refusal through asyncpg (no such database, no
    such table: not migrated, not allowed) or the connection it closed. asyncpg's other
    errors are misuse, a bug: their traceback stays."""
    asyncpg = sys.modules.get("asyncpg")
    if asyncpg is not None and isinstance(exc, asyncpg.ClientConfigurationError):
        return f"the URL is not one asyncpg takes: {exc}"  # sslmode=bogus: the operator's input
    if asyncpg is None or not isinstance(exc, asyncpg.PostgresError):  # closed ones are too
        return None
    return postgres_refused(str(exc), getattr(exc, "sqlstate", None))


def rabbitmq_said(exc: BaseException) -> str | None:
    """What RabbitMQ's refusal means, when `exc` is one. A connection it closes as it opens
    (no such vhost, a user not allowed on it) reaches aiormq as a frame it did not expect,
    which says nothing of why."""
    aiormq = sys.modules.get("aiormq")
    if aiormq is None or not isinstance(exc, aiormq.exceptions.AMQPError):
        return None
    if isinstance(exc, aiormq.exceptions.InvalidFrameError) and "Connection.Close" in str(exc):
        return (
            "it closed the connection as it opened: is the vhost in SKED_RABBITMQ_URL there, "
            "and may its user use it?"
        )
    return str(exc) or type(exc).__name__


class AmqpAway(ConnectionError):
    """RabbitMQ's connection is down and not yet back: a transient error (an OSError), where
    aiormq says it with a bare RuntimeError."""


class StatementOverran(TimeoutError):
    """A statement on a pooled connection overran its pool's bound (shared.store.db.pooled):
    its connection was dropped. Transient, like any timeout; but a batch that overran is split
    (shared.resilience.isolate), as one canceled by statement_timeout is: a batch too big for
    the bound, retried whole, would overrun for ever."""
