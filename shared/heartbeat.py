"""Heartbeats: the message, the per-attempt token, and the loss-confirmation ladder (pure).

A heartbeat (from a task's own process over HTTP, or a sidecar over RabbitMQ) names a task, an
attempt and a sequence number that increases with every beat of that attempt (milliseconds
since the epoch will do), and proves itself with that attempt's token: over HTTP as a bearer
token, over RabbitMQ in each beat, since whoever may publish to `sked.heartbeats` could
otherwise keep any attempt of any task from ever being judged. Executors do not beat: they
renew their attempts' leases in Postgres (shared.lease). Postgres applies one only to the
attempt Running now and only if its sequence is higher than the last applied, so a beat of an
older attempt, or a replay, changes nothing.
"""

from __future__ import annotations

import functools
import hmac
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal
from uuid import UUID

from pydantic import BaseModel, ConfigDict, Field

from shared.models import SCHEMA_VERSION
from shared.outcome import Report

INT32_MAX = 2**31 - 1  # Postgres's integer: an attempt number above it is refused, not stored
INT64_MAX = 2**63 - 1  # ... and bigint: a sequence number


class Beat(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    task_id: UUID
    attempt: int = Field(ge=1, le=INT32_MAX)
    seq: int = Field(ge=1, le=INT64_MAX)


class SignedBeat(Beat):
    """A beat over RabbitMQ: it carries its attempt's token (`token()`, as `SKED_HEARTBEAT_TOKEN`
    gives it to the attempt's process), checked beat by beat."""

    token: str = Field(min_length=1, max_length=128)


class NodeBeat(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    id: str = Field(max_length=63)
    boot_id: UUID
    load: float


class BeatMessage(BaseModel):
    """Heartbeats over RabbitMQ (`sked.heartbeats`): a sender, and the attempts it beats for."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: Literal[1] = SCHEMA_VERSION
    node: NodeBeat
    beats: list[SignedBeat] = Field(max_length=100_000)


class Probe(BaseModel):
    """Monitor -> executor: what about this attempt?"""

    model_config = ConfigDict(extra="forbid", frozen=True)

    task_id: UUID
    attempt: int = Field(ge=1, le=INT32_MAX)
    # "state": how the attempt stands (the monitor's ladder); "log": its log as it is now
    # (`sked logs` of a running attempt: a pod's log, a local process's log file)
    want: Literal["state", "log"] = "state"


LIVE_LOG_CHARS = 64 * 1024


class ProbeAnswer(BaseModel):
    """Executor -> monitor. Whoever may bind a queue to `sked.probe` sees every probe and can
    answer it first, so the monitor believes only an answer `answer` made: it names the
    attempt asked about and carries a MAC under SKED_HEARTBEAT_SECRET (`believe`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # frozen: its lease lapsed and the node's watchdog stopped it (as good as no answer)
    state: Literal["running", "finished", "frozen", "unknown"]
    report: Report | None = None  # with "finished": the real outcome
    log: str | None = Field(default=None, max_length=LIVE_LOG_CHARS)  # with want="log"
    task_id: UUID | None = None
    attempt: int | None = Field(default=None, ge=1, le=INT32_MAX)
    mac: str | None = Field(default=None, max_length=64)  # last: see `answer`


def answer(
    secret: str,
    correlation_id: str | None,
    probe: Probe,
    state: Literal["running", "finished", "frozen", "unknown"],
    report: Report | None = None,
    log: str | None = None,
) -> ProbeAnswer:
    """The executor's signed answer to `probe` (received with `correlation_id`), to be sent
    as `model_dump_json()`. The MAC covers the correlation id and the exact bytes of the
    answer's JSON without its MAC — task, attempt, state, report, log — which are the sent
    JSON's bytes up to the MAC, the last field: nothing is signed that was not sent as is, so
    no float or string has to survive a round trip for the MAC to hold."""
    unsigned = ProbeAnswer(
        state=state, report=report, log=log, task_id=probe.task_id, attempt=probe.attempt
    )
    signed = unsigned.model_dump_json(exclude={"mac"}).encode()
    return unsigned.model_copy(update={"mac": _answer_mac(secret, correlation_id, signed)})


def believer(secret: str, correlation_id: str, probe: Probe) -> Callable[[bytes], bool]:
    """Whether an answer's body is one `believe` takes: the `accept` of a probe's request."""

    def believed(body: bytes) -> bool:
        try:
            believe(secret, correlation_id, probe, body)
        except ValueError:
            return False
        return True

    return believed


def believe(secret: str, correlation_id: str, probe: Probe, body: bytes) -> ProbeAnswer:
    """The answer in `body` if `answer` made it, under `secret`, for this probe sent with this
    correlation id; else ValueError saying why (unreadable, unsigned, a wrong MAC, another
    attempt's). The monitor takes anything else as no answer."""
    got = ProbeAnswer.model_validate_json(body)  # ValidationError is a ValueError
    if got.mac is None:
        raise ValueError("unsigned")
    tail = b',"mac":"' + got.mac.encode() + b'"}'
    if not body.endswith(tail):
        raise ValueError("not as signed")
    signed = body[: -len(tail)] + b"}"
    expected = _answer_mac(secret, correlation_id, signed).encode()
    if not hmac.compare_digest(expected, got.mac.encode("utf-8", "surrogateescape")):
        raise ValueError("wrong MAC")
    if (got.task_id, got.attempt) != (probe.task_id, probe.attempt):
        raise ValueError(f"about {got.task_id} attempt {got.attempt}")
    return got


def _answer_mac(secret: str, correlation_id: str | None, signed: bytes) -> str:
    # "answer:" keeps these MACs apart from the tokens (`token`) under the same secret
    signer = _keyed(secret).copy()
    signer.update(b"answer:" + (correlation_id or "").encode() + b"\n" + signed)
    return signer.hexdigest()


def token(secret: str, task_id: UUID, attempt: int) -> str:
    """The bearer token that lets one attempt's process heartbeat over HTTP, and no other."""
    signer = _keyed(secret).copy()
    signer.update(f"{task_id}:{attempt}".encode())
    return signer.hexdigest()


@functools.lru_cache(maxsize=8)
def _keyed(secret: str) -> hmac.HMAC:
    # HMAC-SHA256 keyed once, copied per token: a third less than keying it anew every time
    # (hmac.digest), once for every attempt an executor starts
    return hmac.new(secret.encode(), digestmod="sha256")


def token_ok(secret: str, task_id: UUID, attempt: int, presented: str) -> bool:
    # compared as bytes: compare_digest raises TypeError for a str with any non-ASCII
    # character, which a forged token may hold (aiohttp keeps undecodable bytes as surrogates)
    given = presented.encode("utf-8", "surrogateescape")
    return hmac.compare_digest(token(secret, task_id, attempt).encode(), given)


class Rung(StrEnum):
    GRACE = "grace"  # the node is alive: allow up to twice the timeout
    RESTORE = "restore"  # the backend says the job runs: the heartbeat was lost, not the job
    RECONCILE = "reconcile"  # the backend says the job ended: record its real outcome
    LOST = "lost"


@dataclass(frozen=True)
class Evidence:
    """What the monitor knows about an overdue attempt when it decides."""

    overdue_s: float  # now - (last heartbeat + timeout): grace lasts while this < timeout
    timeout_s: float
    node_alive: bool
    backend: str | None  # "running" | "finished" | "unknown" | None (no answer)


def next_rung(e: Evidence) -> Rung:
    """The confirmation ladder of an overdue attempt, one rung at a time.

    The monitor asks the backend first, because its answer settles the question at once:
    still running -> restore the heartbeat (it was the heartbeat that got lost); finished ->
    reconcile to the real outcome; the backend does not know the attempt -> Lost. Without an
    answer, a node that is still ready earns a grace up to twice the timeout (the next rung is
    taken when it runs out); a node that is gone, or a grace spent, -> Lost.
    """
    if e.backend == "running":
        return Rung.RESTORE
    if e.backend == "finished":
        return Rung.RECONCILE
    if e.backend is None and e.node_alive and e.overdue_s < e.timeout_s:
        return Rung.GRACE
    return Rung.LOST
