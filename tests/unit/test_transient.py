"""The one list of transient errors: what a server restart, failover, connection limit, admin
cancel, resource alarm or read-only replica raises is retried; a bug is not."""

from __future__ import annotations

import aiormq.exceptions
import asyncpg.exceptions as pg
import pytest
import redis.exceptions as rd

from shared.resilience import is_transient

RETRIED = [
    ConnectionResetError(),
    TimeoutError(),
    pg.ConnectionDoesNotExistError("closed"),
    pg.AdminShutdownError(),
    pg.CrashShutdownError(),
    pg.CannotConnectNowError(),
    pg.QueryCanceledError(),
    pg.TooManyConnectionsError(),
    pg.DiskFullError(),
    pg.ReadOnlySQLTransactionError(),
    pg.IdleInTransactionSessionTimeoutError(),
    pg.DeadlockDetectedError(),
    pg.SerializationError(),
    pg.TargetServerAttributeNotMatched("replica"),
    rd.ConnectionError(),
    rd.ReadOnlyError(),
    rd.BusyLoadingError(),
    rd.TryAgainError(),
    aiormq.exceptions.ChannelInvalidStateError(),
    aiormq.exceptions.DeliveryError(None, None),
]
NOT_RETRIED = [
    ValueError("a bug"),
    KeyError("x"),
    pg.UndefinedColumnError(),
    pg.UniqueViolationError(),
    pg.DataError(),
    rd.ResponseError("WRONGTYPE"),
]


@pytest.mark.parametrize("error", RETRIED, ids=lambda e: type(e).__name__)
def test_what_servers_do_to_connections_is_retried(error: BaseException) -> None:
    assert is_transient(error)


@pytest.mark.parametrize("error", NOT_RETRIED, ids=lambda e: type(e).__name__)
def test_bugs_and_bad_data_are_not(error: BaseException) -> None:
    assert not is_transient(error)
