"""The loss-confirmation ladder and heartbeat tokens (pure)."""

from __future__ import annotations

import hashlib
import hmac
from uuid import UUID

import pytest

from shared import heartbeat
from shared.heartbeat import Evidence, Rung, next_rung

T = 3.0


@pytest.mark.parametrize(
    ("evidence", "rung"),
    [
        # the backend's answer settles it, whatever else is known
        (Evidence(0.1, T, True, "running"), Rung.RESTORE),
        (Evidence(9.0, T, True, "running"), Rung.RESTORE),
        (Evidence(0.1, T, True, "finished"), Rung.RECONCILE),
        (Evidence(0.1, T, True, "unknown"), Rung.LOST),
        # no answer: a node still ready gets a grace up to twice the timeout
        (Evidence(0.1, T, True, None), Rung.GRACE),
        (Evidence(2.9, T, True, None), Rung.GRACE),
        (Evidence(3.0, T, True, None), Rung.LOST),
        # a node that is gone gets no grace
        (Evidence(0.1, T, False, None), Rung.LOST),
    ],
)
def test_ladder(evidence: Evidence, rung: Rung) -> None:
    assert next_rung(evidence) is rung


def test_tokens_are_per_attempt_and_per_secret() -> None:
    task = UUID(int=7)
    token = heartbeat.token("s", task, 2)
    assert heartbeat.token_ok("s", task, 2, token)
    assert not heartbeat.token_ok("s", task, 1, token)
    assert not heartbeat.token_ok("s", UUID(int=8), 2, token)
    assert not heartbeat.token_ok("other", task, 2, token)
    assert not heartbeat.token_ok("s", task, 2, token[:-1] + "0")


def test_a_token_is_the_hmac_sha256_of_task_and_attempt() -> None:
    task_id = UUID("12345678-1234-5678-1234-567812345678")
    want = hmac.new(b"s" * 32, f"{task_id}:3".encode(), hashlib.sha256).hexdigest()
    assert heartbeat.token("s" * 32, task_id, 3) == want
    assert heartbeat.token_ok("s" * 32, task_id, 3, want)
    assert not heartbeat.token_ok("s" * 32, task_id, 4, want)
