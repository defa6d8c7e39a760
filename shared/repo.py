"""The CAS repository: the only code that writes task state to Postgres.

A transition is one statement: `UPDATE tasks … WHERE id = $ AND version = $ AND status = $`,
the task_events row (history and outbox at once) and a small `pg_notify`, all in one implicit
transaction, so a state change and the event announcing it can never diverge. Batches move many
tasks in the same one statement (`unnest`), which is what makes the pipeline fast.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from uuid import UUID, uuid4

import asyncpg

from shared import fsm, telemetry
from shared.dag import effective_priorities
from shared.errors import NotFound
from shared.fsm import Move, State
from shared.models import Event, Task, TaskSpec

log = logging.getLogger(__name__)

# NOTIFY channel for state changes, one notification per transaction, because every notifying
# commit serialises on Postgres's notification queue. Payload: "<id>:<version>:<state>" for
# each task moved, space-separated, up to NOTIFY_LIST_MAX tasks (about 5 KB, under the 8 KB
# limit); a bigger batch sends only "*:<count>:<state,state…>". See `parse_notify`.
TASK_CHANNEL = "sked_task"
NOTIFY_LIST_MAX = 100


@dataclass(frozen=True)
class Notice:
    """A parsed state-change notification: which tasks (None: too many to list), which states."""

    ids: frozenset[UUID] | None
    states: frozenset[str]


def parse_notify(payload: str) -> Notice:
    if payload.startswith("*:"):
        return Notice(None, frozenset(payload.rsplit(":", 1)[-1].split(",")))
    ids, states = set(), set()
    for entry in payload.split():
        task_id, _, state = entry.split(":")
        ids.add(UUID(task_id))
        states.add(state)
    return Notice(frozenset(ids), frozenset(states))


_TASK_COLUMNS = (
    "id, name, kind, spec::text AS spec_json, status, status_reason, version, attempt, "
    "priority, retry_count, max_retries, next_retry_at, timeout_s, heartbeat_timeout_s, "
    "node, idempotency_key, "
    "paused_by, paused_reason, paused_at, result, error, created_at, updated_at, queued_at, "
    "started_at, finished_at, log_tail, cpu, memory_mb, gpu, traceparent, hb_at, hb_deadline, "
    "hb_seq, workflow_id, wf_task, uses, inputs, lease_owner, lease_attempt, lease_until"
)
# the same columns by name, for reading back from a CTE that returned _TASK_COLUMNS
_TASK_FIELDS = ", ".join(c.strip().split(" AS ")[-1] for c in _TASK_COLUMNS.split(","))
_EVENT_COLUMNS = "id, task_id, from_status, to_status, version, attempt, reason, at, published_at"


async def _init_connection(conn: asyncpg.Connection) -> None:
    await conn.set_type_codec("jsonb", encoder=json.dumps, decoder=json.loads, schema="pg_catalog")


async def create_pool(dsn: str, size: int = 8) -> asyncpg.Pool:
    pool = await asyncpg.create_pool(
        dsn, min_size=1, max_size=size, init=_init_connection, command_timeout=60
    )
    assert pool is not None
    return pool


def _task(row: asyncpg.Record) -> Task:
    return Task.from_row(row)


def _event(row: asyncpg.Record) -> Event:
    return Event.model_validate(dict(row))


def _notify_from(cte: str) -> str:
    """The one NOTIFY of a statement that moved the rows of `cte` (see TASK_CHANNEL)."""
    return f"""
    SELECT pg_notify('{TASK_CHANNEL}',
                     CASE WHEN count(*) <= {NOTIFY_LIST_MAX}
                          THEN string_agg(id::text || ':' || version || ':' || status, ' ')
                          ELSE '*:' || count(*) || ':' || string_agg(DISTINCT status, ',') END)
    FROM {cte}
    HAVING count(*) > 0
"""


def _locked_in_id_order(where: str = "true", *, skip_locked: bool = False) -> str:
    """The body of a CTE that locks the tasks a statement's CTE `u` names, in id order.

    Every statement that writes several task rows locks them through this first: an UPDATE
    locks rows in whatever order its join visits them, so two batches over overlapping rows
    could each hold one the other waits for; locked in one order, they queue instead. After a
    wait FOR UPDATE re-checks `where` on the newest row, so a row that no longer qualifies is
    not written. `skip_locked` passes over rows others hold (for writes that may be dropped).
    """
    skip = " SKIP LOCKED" if skip_locked else ""
    return (
        f"SELECT t.id FROM tasks t JOIN u ON u.id = t.id WHERE {where} "
        f"ORDER BY t.id FOR UPDATE OF t{skip}"
    )


# A move out of Running that proves the attempt's process ended; Paused and Canceled do not.
_ENDS_LEASE = "u.from_status = 'running' AND u.to_status NOT IN ('paused', 'canceled')"
# The lease has run out by the safety margin ($7): its process is frozen or dead by now.
_LEASE_OVER = "(t.lease_until IS NULL OR t.lease_until + make_interval(secs => $7) < now())"


# Creation and the first moves of a new task in one statement: the row is inserted in its
# final state of the walk ($13-$15, planned by fsm.walk, e.g. Created -> Pending -> Ready) with
# one event row per step. Nobody else can hold a row this statement creates, so no CAS is
# needed; the FSM has checked every step.
INSERT_TASKS = f"""
WITH w AS (
    SELECT * FROM unnest($13::text[], $14::text[], $15::text[]) WITH ORDINALITY
                  AS w(from_status, to_status, reason, version)
), last AS (
    SELECT to_status, reason, version FROM w ORDER BY version DESC LIMIT 1
), ins AS (
    INSERT INTO tasks (id, name, kind, spec, status, status_reason, version, priority,
                       max_retries, timeout_s, heartbeat_timeout_s, idempotency_key, cpu,
                       memory_mb, gpu, traceparent, queued_at, workflow_id, wf_task, uses)
    SELECT u.id, u.name, u.kind, u.spec::jsonb, last.to_status, last.reason, last.version,
           u.priority, u.max_retries, u.timeout_s, u.hb, u.ikey, u.cpu, u.memory_mb, u.gpu,
           u.traceparent, CASE WHEN last.to_status = 'ready' THEN now() END, $17::uuid,
           CASE WHEN $17::uuid IS NULL THEN NULL ELSE u.name END,
           ARRAY(SELECT jsonb_array_elements_text(u.uses::jsonb))
    FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::int[], $6::int[],
                $7::float8[], $8::float8[], $9::text[], $10::float8[], $11::bigint[],
                $12::int[], $16::text[], $18::text[])
         AS u(id, name, kind, spec, priority, max_retries, timeout_s, hb, ikey, cpu, memory_mb,
              gpu, traceparent, uses)
    CROSS JOIN last
    -- a redelivered submission (same id) or a reused idempotency key creates nothing
    ON CONFLICT DO NOTHING
    RETURNING {_TASK_COLUMNS}
), ev AS (
    INSERT INTO task_events (task_id, from_status, to_status, version, attempt, reason)
    SELECT ins.id, w.from_status, w.to_status, w.version, 0, w.reason FROM ins CROSS JOIN w
), note AS ({_notify_from("ins")})
SELECT {_TASK_FIELDS}, (SELECT count(*) FROM note) AS _notified FROM ins
"""

SELECT_EXISTING = f"""
SELECT {_TASK_COLUMNS} FROM tasks WHERE id = ANY($1::uuid[]) OR idempotency_key = ANY($2::text[])
"""

# The CAS. `u.p` is the move's patch (jsonb): a key present sets its column, a key absent keeps
# it. The status guard beside the version guard makes a wrong `source` in a Move a lost race
# rather than a silent jump. $7 is the lease safety margin (seconds).
#
# Leases (docs/architecture.md, "At most one live attempt"): a move into Running takes a lease
# for the attempt until now() + heartbeat timeout; a move out of Running that proves the
# process ended (an outcome, or Lost, which needs the lease expired) ends it; Paused and
# Canceled keep it, because the process may still run until its executor stops it. Lost and
# the start of a next attempt wait until the lease has run out by the margin.
TRANSITION = f"""
WITH u AS (
    SELECT id, version, from_status, to_status, reason, patch::jsonb AS p
    FROM unnest($1::uuid[], $2::int[], $3::text[], $4::text[], $5::text[], $6::text[])
         AS u(id, version, from_status, to_status, reason, patch)
), locked AS (
    -- the rows the CAS will win, locked in id order whatever order the caller gave
    {_locked_in_id_order("t.version = u.version AND t.status = u.from_status")}
), moved AS (
    UPDATE tasks t SET
        status = u.to_status,
        status_reason = u.reason,
        version = t.version + 1,
        updated_at = now(),
        attempt = COALESCE((u.p ->> 'attempt')::int, t.attempt),
        retry_count = COALESCE((u.p ->> 'retry_count')::int, t.retry_count),
        node = CASE WHEN u.p ? 'node' THEN u.p ->> 'node' ELSE t.node END,
        next_retry_at = CASE WHEN u.p ? 'retry_in_s'
                             THEN now() + make_interval(secs => (u.p ->> 'retry_in_s')::float8)
                             ELSE t.next_retry_at END,
        result = CASE WHEN u.p ? 'result' THEN NULLIF(u.p -> 'result', 'null'::jsonb)
                      ELSE t.result END,
        error = CASE WHEN u.p ? 'error' THEN u.p ->> 'error' ELSE t.error END,
        log_tail = CASE WHEN u.p ? 'log_tail' THEN u.p ->> 'log_tail' ELSE t.log_tail END,
        inputs = CASE WHEN u.p ? 'inputs' THEN u.p -> 'inputs' ELSE t.inputs END,
        paused_by = CASE WHEN u.p ? 'paused_by' THEN u.p ->> 'paused_by' ELSE t.paused_by END,
        paused_reason = CASE WHEN u.p ? 'paused_reason' THEN u.p ->> 'paused_reason'
                             ELSE t.paused_reason END,
        paused_at = CASE WHEN u.to_status = 'paused' THEN now() ELSE t.paused_at END,
        queued_at = CASE WHEN u.to_status = 'ready' THEN now() ELSE t.queued_at END,
        started_at = CASE WHEN u.to_status = 'running' THEN now() ELSE t.started_at END,
        -- a new Running attempt starts its heartbeat clock and its lease from zero
        hb_at = CASE WHEN u.to_status = 'running' THEN now() ELSE t.hb_at END,
        hb_deadline = CASE WHEN u.to_status = 'running'
                           THEN now() + make_interval(secs => t.heartbeat_timeout_s + $7)
                           ELSE t.hb_deadline END,
        hb_seq = CASE WHEN u.to_status = 'running' THEN 0 ELSE t.hb_seq END,
        lease_owner = CASE WHEN u.to_status = 'running' THEN (u.p ->> 'lease_owner')::uuid
                           WHEN {_ENDS_LEASE} THEN NULL ELSE t.lease_owner END,
        lease_attempt = CASE WHEN u.to_status = 'running' THEN t.attempt
                             WHEN {_ENDS_LEASE} THEN NULL ELSE t.lease_attempt END,
        lease_until = CASE WHEN u.to_status = 'running'
                           THEN now() + make_interval(secs => t.heartbeat_timeout_s)
                           WHEN {_ENDS_LEASE} THEN NULL ELSE t.lease_until END,
        finished_at = CASE WHEN u.to_status IN ('success', 'failed', 'timed_out', 'canceled',
                                                'skipped')
                           THEN now() ELSE t.finished_at END
    FROM u JOIN locked USING (id)
    WHERE t.id = u.id AND t.version = u.version AND t.status = u.from_status
      AND (u.to_status NOT IN ('lost', 'running') OR {_LEASE_OVER})
    RETURNING {", ".join("t." + c.strip() for c in _TASK_COLUMNS.split(","))},
              u.from_status AS _from, u.reason AS _reason
), ev AS (
    INSERT INTO task_events (task_id, from_status, to_status, version, attempt, reason)
    SELECT id, _from, status, version, attempt, _reason FROM moved
), note AS ({_notify_from("moved")})
SELECT {_TASK_FIELDS}, (SELECT count(*) FROM note) AS _notified FROM moved
"""

GET_TASK = f"SELECT {_TASK_COLUMNS} FROM tasks WHERE id = $1"
GET_TASKS = f"SELECT {_TASK_COLUMNS} FROM tasks WHERE id = ANY($1::uuid[])"
# Those of these tasks still Ready; `_fenced`: an earlier attempt still holds a lease (paused
# while its executor could not hear it), so this one may not start yet.
GET_READY = f"""
SELECT {_TASK_COLUMNS},
       NOT {_LEASE_OVER.replace("$7", "$2")} AS _fenced
FROM tasks t WHERE id = ANY($1::uuid[]) AND status = 'ready'
"""

# What the ready queue needs to (re)score a task; the reconciler reads only tasks Ready for a
# while, which a live scheduler would have popped already.
READY_FOR_QUEUE = """
SELECT id, priority, queued_at FROM tasks
WHERE status = 'ready' AND queued_at < now() - make_interval(secs => $1)
  AND (queued_at, id) > ($3::timestamptz, $4::uuid)
ORDER BY queued_at, id
LIMIT $2
"""

# A Ready task that cannot be placed says why (only written when the reason changes).
# A row another statement holds is skipped: its reason is cosmetic and the holder is most likely
# placing it right now (and waiting for it here could deadlock with that holder's batch).
SET_WAIT_REASONS = f"""
WITH u AS (SELECT * FROM unnest($1::uuid[], $2::text[]) AS u(id, reason)),
free AS (
    {
    _locked_in_id_order(
        "t.status = 'ready' AND t.status_reason IS DISTINCT FROM u.reason", skip_locked=True
    )
}
)
UPDATE tasks t SET status_reason = u.reason
FROM u JOIN free USING (id)
WHERE t.id = u.id
"""

# Which of these tasks are terminal: Success/Canceled/Skipped, or Failed/TimedOut with no
# retry left (the FSM's is_terminal, in SQL, so waiters fetch only finished rows).
TERMINAL_AMONG = f"""
SELECT {_TASK_COLUMNS} FROM tasks
WHERE id = ANY($1::uuid[])
  AND (status IN ('success', 'canceled', 'skipped')
       OR (status IN ('failed', 'timed_out') AND retry_count >= max_retries))
"""

# Heartbeats, batched: applied only to the attempt that is Running now and only when newer
# than the last applied (fencing: a heartbeat of an older attempt, or a replay, changes
# nothing). Not a state change: no version bump, no event.
# Rows are locked in id order, like TRANSITION's, so a batch of heartbeats and an executor's
# batch of finishes over the same tasks never deadlock.
APPLY_HEARTBEATS = f"""
WITH u AS (SELECT * FROM unnest($1::uuid[], $2::int[], $3::bigint[]) AS u(id, attempt, seq)),
locked AS (
    {_locked_in_id_order("t.status = 'running' AND t.attempt = u.attempt AND u.seq > t.hb_seq")}
)
UPDATE tasks t SET hb_seq = u.seq, hb_at = now(),
                   hb_deadline = greatest(t.hb_deadline,
                                          now() + make_interval(secs => t.heartbeat_timeout_s))
FROM u JOIN locked USING (id)
WHERE t.id = u.id AND t.status = 'running' AND t.attempt = u.attempt AND u.seq > t.hb_seq
RETURNING t.id, t.attempt
"""

# An executor renews the leases of the attempts it runs ($1: its incarnation, $4: the margin):
# only an attempt still Running, in that attempt, under this owner. The rows it returns are
# the executor's proof that Postgres holds each lease for a heartbeat timeout from now.
RENEW_LEASES = f"""
WITH u AS (SELECT * FROM unnest($2::uuid[], $3::int[]) AS u(id, attempt)),
locked AS (
    {_locked_in_id_order("t.status = 'running' AND t.attempt = u.attempt AND t.lease_owner = $1")}
)
UPDATE tasks t SET
    lease_until = greatest(t.lease_until, now() + make_interval(secs => t.heartbeat_timeout_s)),
    hb_deadline = greatest(t.hb_deadline,
                           now() + make_interval(secs => t.heartbeat_timeout_s + $4))
FROM u JOIN locked USING (id)
WHERE t.id = u.id AND t.status = 'running' AND t.attempt = u.attempt AND t.lease_owner = $1
RETURNING t.id, t.attempt
"""

# An executor gives up the lease of an attempt it no longer runs (paused or canceled, and its
# process is gone now), so that the task's next attempt need not wait for the lease to lapse.
RELEASE_LEASES = f"""
WITH u AS (SELECT * FROM unnest($2::uuid[], $3::int[]) AS u(id, attempt)),
locked AS (
    {
    _locked_in_id_order(
        "t.lease_owner = $1 AND t.lease_attempt = u.attempt"
        " AND NOT (t.status = 'running' AND t.attempt = u.attempt)"
    )
}
)
UPDATE tasks t SET lease_owner = NULL, lease_attempt = NULL, lease_until = NULL
FROM u JOIN locked USING (id)
WHERE t.id = u.id AND t.lease_owner = $1 AND t.lease_attempt = u.attempt
  AND NOT (t.status = 'running' AND t.attempt = u.attempt)
"""

# The heartbeat-monitor's sweep: overdue Running attempts, leased for `$2` seconds (the
# deadline moves on) so that replicas never work on the same one at once. `_silent_s` is how
# long ago the attempt's lease was last renewed (Postgres time: one clock).
LEASE_OVERDUE = f"""
WITH due AS (
    SELECT id FROM tasks
    WHERE status = 'running' AND hb_deadline < now()
    ORDER BY hb_deadline
    LIMIT $1
    FOR UPDATE SKIP LOCKED
)
UPDATE tasks t SET hb_deadline = now() + make_interval(secs => $2)
FROM due WHERE t.id = due.id
RETURNING {", ".join("t." + c.strip() for c in _TASK_COLUMNS.split(","))},
    extract(epoch FROM now() - COALESCE(
        t.lease_until - make_interval(secs => t.heartbeat_timeout_s), t.hb_at, t.started_at
    ))::float8 AS _silent_s
"""

# The ladder's grace: look again when twice the timeout has passed since the last renewal.
GRACE_DEADLINE = """
UPDATE tasks SET hb_deadline = COALESCE(lease_until, hb_at, now())
                               + make_interval(secs => heartbeat_timeout_s)
WHERE id = $1 AND attempt = $2 AND status = 'running'
"""

# The ladder's restore: the backend says the attempt runs; look again a timeout from now.
RESTORE_DEADLINE = """
UPDATE tasks SET hb_deadline = now() + make_interval(secs => heartbeat_timeout_s + $3)
WHERE id = $1 AND attempt = $2 AND status = 'running'
"""

# After an outage (or when a monitor starts) no deadline is judged before the executors had a
# heartbeat timeout to renew: the time they could not reach Postgres is not held against them.
RESTART_DEADLINES = """
UPDATE tasks SET hb_deadline = greatest(hb_deadline,
                                        now() + make_interval(secs => heartbeat_timeout_s + $1))
WHERE status = 'running'
"""

# Seconds until the earliest deadline (Postgres time), and when this Postgres started: a
# restart since the last look is an outage the monitor slept through.
NEXT_DEADLINE = """
SELECT (SELECT extract(epoch FROM min(hb_deadline) - now())::float8
        FROM tasks WHERE status = 'running') AS wait_s,
       extract(epoch FROM pg_postmaster_start_time())::float8 AS started
"""

CLAIM_LOST = f"""
SELECT {_TASK_COLUMNS} FROM tasks
WHERE status = 'lost'
ORDER BY updated_at
LIMIT $1
FOR UPDATE SKIP LOCKED
"""

CLAIM_STUCK_SCHEDULING = f"""
SELECT {_TASK_COLUMNS} FROM tasks
WHERE status = 'scheduling' AND updated_at < now() - make_interval(secs => $2)
ORDER BY updated_at
LIMIT $1
FOR UPDATE SKIP LOCKED
"""

RECORD_LATE_RESULTS = """
INSERT INTO late_results (task_id, attempt, ok, result, error, note)
SELECT * FROM unnest($1::uuid[], $2::int[], $3::bool[], $4::jsonb[], $5::text[], $6::text[])
"""

# -- workflows -------------------------------------------------------------------------------

INSERT_WORKFLOW = """
INSERT INTO workflows (id, name, spec) VALUES ($1, $2, $3::jsonb)
ON CONFLICT (id) DO NOTHING
RETURNING id
"""
WORKFLOW_SPEC = "SELECT spec FROM workflows WHERE id = $1"
INSERT_DEPS = """
INSERT INTO task_deps (task_id, upstream_id, condition, timeout_s, on_timeout, default_value)
SELECT u.task_id, u.upstream_id, u.condition, u.timeout_s, u.on_timeout, u.dflt::jsonb
FROM unnest($1::uuid[], $2::uuid[], $3::text[], $4::float8[], $5::text[], $6::text[])
     AS u(task_id, upstream_id, condition, timeout_s, on_timeout, dflt)
ON CONFLICT DO NOTHING
"""
DOWNSTREAM_OF = "SELECT DISTINCT task_id FROM task_deps WHERE upstream_id = ANY($1::uuid[])"
# the downstream tasks to decide, locked: a second decider waits here, then sees the first's
LOCK_PENDING = f"""
SELECT {_TASK_COLUMNS} FROM tasks
WHERE id = ANY($1::uuid[]) AND status = 'pending'
ORDER BY id
FOR UPDATE
"""
EDGES_OF = """
SELECT d.task_id, d.upstream_id, d.condition, u.status, u.retry_count, u.max_retries,
       d.timeout_s, d.on_timeout, d.timed_out_at, d.default_value, u.wf_task AS upstream_name,
       u.kind AS upstream_kind, u.result AS upstream_result,
       t.updated_at + make_interval(secs => d.timeout_s) <= now() AS overdue
FROM task_deps d JOIN tasks u ON u.id = d.upstream_id JOIN tasks t ON t.id = d.task_id
WHERE d.task_id = ANY($1::uuid[])
"""
MARK_TIMED_OUT = """
UPDATE task_deps SET timed_out_at = now()
FROM unnest($1::uuid[], $2::uuid[]) AS u(task_id, upstream_id)
WHERE task_deps.task_id = u.task_id AND task_deps.upstream_id = u.upstream_id
  AND task_deps.timed_out_at IS NULL
"""
PENDING_WITH_DEPS = """
SELECT DISTINCT d.task_id FROM task_deps d JOIN tasks t ON t.id = d.task_id
WHERE t.status = 'pending'
LIMIT $1
"""
GET_WORKFLOW = "SELECT id, name, spec::text AS spec, created_at FROM workflows WHERE id = $1"
WORKFLOW_TASKS = f"SELECT {_TASK_COLUMNS} FROM tasks WHERE workflow_id = $1 ORDER BY wf_task"
WORKFLOW_EDGES = """
SELECT d.task_id, d.upstream_id, d.condition
FROM task_deps d JOIN tasks t ON t.id = d.task_id
WHERE t.workflow_id = $1
"""
HAS_DEPS = "SELECT EXISTS (SELECT 1 FROM task_deps WHERE task_id = $1)"

# Workflow resources: capacity (from the workflow) and how many units are held now, by
# tasks Scheduling or Running. Read under the placement locks, so it is current.
RESOURCES_HELD = """
SELECT w.id AS workflow_id, r.name, r.capacity::int AS capacity,
       (SELECT count(*) FROM tasks t
        WHERE t.workflow_id = w.id AND t.status IN ('scheduling', 'running')
          AND r.name = ANY(t.uses)) AS held
FROM workflows w, jsonb_each_text(w.spec -> 'resources') AS r(name, capacity)
WHERE w.id = ANY($1::uuid[])
"""

# Seconds until the earliest retry is due, by Postgres's clock (None: no task waits).
NEXT_RETRY_DUE = """
SELECT extract(epoch FROM min(next_retry_at) - now())::float8 FROM tasks
WHERE status = 'retry_wait'
"""

LIST_TASKS = f"""
SELECT {_TASK_COLUMNS} FROM tasks
WHERE ($1::text[] IS NULL OR status = ANY($1))
  AND ($2::text IS NULL OR name = $2)
ORDER BY created_at DESC, id
LIMIT $3
"""

# Priority changes (not a state change: no version bump, no event). A workflow's recomputation
# is serialised per workflow by an advisory lock, so two changes never mix stale own priorities.
LOCK_WORKFLOW_PRIORITIES = "SELECT pg_advisory_xact_lock(hashtextextended($1::text, 7))"
WORKFLOW_PRIORITIES = """
SELECT id, wf_task, priority, (spec ->> 'priority')::int AS own FROM tasks WHERE workflow_id = $1
"""
# One statement, rows locked in id order like TRANSITION's: the task's own priority goes into
# its spec, and every effective priority that changed into the priority column.
SET_PRIORITIES = f"""
WITH u AS (SELECT * FROM unnest($1::uuid[], $2::int[]) AS u(id, priority)),
locked AS ({_locked_in_id_order()})
UPDATE tasks t SET
    priority = u.priority,
    spec = CASE WHEN t.id = $3 THEN jsonb_set(t.spec, '{{priority}}', to_jsonb($4::int))
                ELSE t.spec END
FROM u JOIN locked USING (id)
WHERE t.id = u.id
RETURNING {", ".join("t." + c.strip() for c in _TASK_COLUMNS.split(","))}
"""

# Which of these (task, Running version) attempts were ended by a move whose reason starts
# with $3 (a failure's reason goes on with its error).
ENDED_WITH = """
SELECT e.task_id FROM task_events e
JOIN unnest($1::uuid[], $2::int[]) AS u(id, version)
  ON e.task_id = u.id AND e.version = u.version + 1
WHERE e.from_status = 'running' AND starts_with(e.reason, $3)
"""

HISTORY = f"SELECT {_EVENT_COLUMNS} FROM task_events WHERE task_id = $1 ORDER BY version"

# Claims lock rows with SKIP LOCKED inside a transaction, then move them through the FSM in the
# same transaction: replicas share the work and never claim the same row.
CLAIM_RUNNABLE = f"""
SELECT {_TASK_COLUMNS} FROM tasks
WHERE status = 'ready'
ORDER BY priority DESC, queued_at, id
LIMIT $1
FOR UPDATE SKIP LOCKED
"""

CLAIM_RETRY_DUE = f"""
SELECT {_TASK_COLUMNS} FROM tasks
WHERE status = 'retry_wait' AND next_retry_at <= now()
ORDER BY next_retry_at
LIMIT $1
FOR UPDATE SKIP LOCKED
"""


def _json_default(value: Any) -> Any:
    if hasattr(value, "isoformat"):
        return value.isoformat()
    raise TypeError(f"cannot store {type(value).__name__} in a transition patch")


def _move_args(moves: Sequence[Move]) -> tuple[list[Any], ...]:
    ids = [m.task_id for m in moves]
    if len(set(ids)) != len(ids):
        raise ValueError("a batch may move each task only once")
    return (
        ids,
        [m.version for m in moves],
        [m.source.value for m in moves],
        [m.target.value for m in moves],
        [m.reason for m in moves],
        [json.dumps(dict(m.patch), default=_json_default) for m in moves],
    )


@dataclass(frozen=True)
class QueuedRow:
    id: UUID
    priority: int
    queued_at: datetime | None


class PgTaskRepo:
    """Tasks and their history in Postgres, written only by compare-and-swap.

    `lease_margin_s`: how long past an attempt's lease its task may be declared Lost or start
    its next attempt (the node's watchdog has frozen the old attempt's processes by then).
    """

    def __init__(self, pool: asyncpg.Pool, lease_margin_s: float = 0.5) -> None:
        self.pool = pool
        self.lease_margin_s = lease_margin_s

    # -- creation ---------------------------------------------------------------------------

    async def create(self, spec: TaskSpec, task_id: UUID | None = None) -> Task:
        return (await self.create_many([spec], None if task_id is None else [task_id]))[0]

    async def admit_many(
        self,
        specs: Sequence[TaskSpec],
        ids: Sequence[UUID],
        walk: Sequence[State],
        conn: asyncpg.Connection | None = None,
        traceparents: Sequence[str | None] | None = None,
    ) -> list[tuple[Task, bool]]:
        """Create tasks and walk the new ones from Created through `walk` (checked by the FSM)
        in one statement. Returns each task with whether this statement created it: existing
        ones (a redelivery, a taken idempotency key) come back as they are."""
        tasks, fresh = await self._create_many(specs, ids, conn, walk, traceparents)
        created = {t.id for t in fresh}
        return [(t, t.id in created) for t in tasks]

    async def create_many(
        self,
        specs: Sequence[TaskSpec],
        ids: Sequence[UUID] | None = None,
        conn: asyncpg.Connection | None = None,
        walk: Sequence[State] = (),
        traceparents: Sequence[str | None] | None = None,
        workflow_id: UUID | None = None,
        uses: Sequence[Sequence[str]] | None = None,
        priorities: Sequence[int] | None = None,
    ) -> list[Task]:
        """Insert tasks in Created with their first event; one round trip for the batch.

        `ids` (optional) are producer-chosen task ids: a submission delivered twice creates one
        task. A spec whose idempotency key is already taken yields the existing task.
        `traceparents` (optional) are the tasks' trace contexts (see shared.telemetry).
        `priorities` (optional) are the effective priorities the tasks are queued by (a
        workflow's inherited ones); the spec keeps the priority its producer asked for.
        """
        tasks, _ = await self._create_many(
            specs, ids, conn, walk, traceparents, workflow_id, uses, priorities
        )
        return tasks

    async def _create_many(
        self,
        specs: Sequence[TaskSpec],
        ids: Sequence[UUID] | None = None,
        conn: asyncpg.Connection | None = None,
        walk: Sequence[State] = (),
        traceparents: Sequence[str | None] | None = None,
        workflow_id: UUID | None = None,
        uses: Sequence[Sequence[str]] | None = None,
        priorities: Sequence[int] | None = None,
    ) -> tuple[list[Task], list[Task]]:
        """create_many's work: all the tasks asked for, and those this call created."""
        if not specs:
            return [], []
        ids = list(ids) if ids is not None else [uuid4() for _ in specs]
        steps = fsm.walk(State.CREATED, walk)
        args = (
            ids,
            [s.name for s in specs],
            [s.job.kind for s in specs],
            [s.model_dump_json() for s in specs],
            list(priorities) if priorities is not None else [s.priority for s in specs],
            [s.max_retries for s in specs],
            [s.timeout_s for s in specs],
            [s.heartbeat_timeout_s for s in specs],
            [s.idempotency_key for s in specs],
            [s.resources.cpu for s in specs],
            [s.resources.memory_mb for s in specs],
            [s.resources.gpu for s in specs],
            *steps,
            list(traceparents) if traceparents is not None else [None] * len(specs),
            workflow_id,
            [json.dumps(list(u)) for u in uses] if uses is not None else ["[]"] * len(specs),
        )
        started = time.time_ns()
        if conn is None:
            async with self.pool.acquire() as c:
                tasks, fresh = await self._create(c, ids, specs, args)
        else:
            tasks, fresh = await self._create(conn, ids, specs, args)
        if telemetry.enabled():
            telemetry.transitions(
                [
                    (t, Move(t.id, i + 1, State(src), State(dst), why))
                    for t in fresh
                    for i, (src, dst, why) in enumerate(zip(*steps, strict=True))
                    if src is not None
                ],
                started,
                time.time_ns(),
            )
        return tasks, fresh

    async def _create(
        self,
        conn: asyncpg.Connection,
        ids: list[UUID],
        specs: Sequence[TaskSpec],
        args: tuple[Any, ...],
    ) -> tuple[list[Task], list[Task]]:
        """All the tasks asked for, in order, and those this statement created."""
        rows = await conn.fetch(INSERT_TASKS, *args)
        created = {row["id"]: _task(row) for row in rows}
        by_id: dict[UUID, Task] = {}
        by_key: dict[str, Task] = {}
        if len(created) < len(ids):
            keys = [s.idempotency_key for s in specs if s.idempotency_key is not None]
            for row in await conn.fetch(SELECT_EXISTING, ids, keys):
                found = _task(row)
                by_id[found.id] = found
                if found.idempotency_key is not None:
                    by_key[found.idempotency_key] = found
        out = []
        for task_id, spec in zip(ids, specs, strict=True):
            task: Task | None = created.get(task_id) or by_id.get(task_id)
            if task is None and spec.idempotency_key is not None:
                task = by_key.get(spec.idempotency_key)
            if task is None:
                raise RuntimeError(f"task {task_id} was neither created nor found")
            out.append(task)
        return out, list(created.values())

    # -- transitions ------------------------------------------------------------------------

    async def transition(self, move: Move) -> Task | None:
        """Apply one planned move. Returns the task after it, or None if this caller lost."""
        moved = await self.transition_many([move])
        return moved[0] if moved else None

    async def transition_many(
        self, moves: Sequence[Move], conn: asyncpg.Connection | None = None
    ) -> list[Task]:
        """Apply many moves in one statement; returns the tasks that moved (the CAS winners),
        in the order of `moves`."""
        if not moves:
            return []
        args = (*_move_args(moves), self.lease_margin_s)
        started = time.time_ns()
        if conn is not None:
            rows = await conn.fetch(TRANSITION, *args)
        else:
            async with self.pool.acquire() as c:
                rows = await c.fetch(TRANSITION, *args)
        won = {row["id"]: row for row in rows}
        moved = [(_task(won[m.task_id]), m) for m in moves if m.task_id in won]
        telemetry.transitions(moved, started, time.time_ns())
        return [task for task, _ in moved]

    async def _claim_and_move(
        self, claim_sql: str, limit: int, target: State, reason: str, **changes: Any
    ) -> list[Task]:
        async with self.pool.acquire() as conn, conn.transaction():
            rows = await conn.fetch(claim_sql, limit)
            moves = [fsm.plan(_task(row), target, reason, **changes) for row in rows]
            return await self.transition_many(moves, conn)

    async def pick_runnable(self, limit: int, node: str | None = None) -> list[Task]:
        """Claim up to `limit` Ready tasks (highest priority, then oldest) into Scheduling.

        Each claimed task gets a new attempt number. Replicas never claim the same task.
        """
        changes = {"node": node} if node is not None else {}
        return await self._claim_and_move(
            CLAIM_RUNNABLE, limit, State.SCHEDULING, "picked", **changes
        )

    async def sweep_due_retries(self, limit: int) -> list[Task]:
        """Move RetryWait tasks whose backoff has elapsed back to Ready."""
        return await self._claim_and_move(CLAIM_RETRY_DUE, limit, State.READY, "backoff elapsed")

    # -- reads ------------------------------------------------------------------------------

    async def get(self, task_id: UUID) -> Task:
        row = await self.pool.fetchrow(GET_TASK, task_id)
        if row is None:
            raise NotFound(f"no task {task_id}")
        return _task(row)

    async def list_tasks(
        self,
        statuses: Iterable[object] | None = None,
        name: str | None = None,
        limit: int = 100,
    ) -> list[Task]:
        wanted = None if statuses is None else [State.parse(s).value for s in statuses]
        rows = await self.pool.fetch(LIST_TASKS, wanted, name, limit)
        return [_task(row) for row in rows]

    async def get_many(self, ids: Sequence[UUID]) -> list[Task]:
        rows = await self.pool.fetch(GET_TASKS, list(ids))
        return [_task(row) for row in rows]

    async def terminal_among(self, ids: Sequence[UUID]) -> list[Task]:
        """Those of `ids` that are terminal (never move again)."""
        return [_task(row) for row in await self.pool.fetch(TERMINAL_AMONG, list(ids))]

    async def get_ready(
        self, ids: Sequence[UUID], conn: asyncpg.Connection
    ) -> tuple[list[Task], list[Task]]:
        """Those of `ids` still Ready (a popped id may have been canceled meanwhile): the ones
        that may start, and the ones an earlier attempt's lease still fences."""
        free: list[Task] = []
        fenced: list[Task] = []
        for row in await conn.fetch(GET_READY, list(ids), self.lease_margin_s):
            (fenced if row["_fenced"] else free).append(_task(row))
        return free, fenced

    async def ready_for_queue(
        self, older_than_s: float, limit: int, after: QueuedRow | None = None
    ) -> list[QueuedRow]:
        """Ready tasks queued more than `older_than_s` ago, oldest first, from after `after`."""
        start = (after.queued_at, after.id) if after is not None else (None, None)
        if start[0] is None:
            start = (datetime.min.replace(tzinfo=UTC), UUID(int=0))
        rows = await self.pool.fetch(READY_FOR_QUEUE, older_than_s, limit, *start)
        return [QueuedRow(r["id"], r["priority"], r["queued_at"]) for r in rows]

    async def set_wait_reasons(self, reasons: dict[UUID, str]) -> None:
        if reasons:
            await self.pool.execute(SET_WAIT_REASONS, list(reasons), list(reasons.values()))

    async def apply_heartbeats(
        self, beats: Sequence[tuple[UUID, int, int]]
    ) -> set[tuple[UUID, int]]:
        """Apply (task id, attempt, seq) heartbeats; returns the (task, attempt) applied."""
        if not beats:
            return set()
        ids, attempts, seqs = (list(x) for x in zip(*beats, strict=True))
        rows = await self.pool.fetch(APPLY_HEARTBEATS, ids, attempts, seqs)
        return {(r["id"], r["attempt"]) for r in rows}

    async def renew_leases(
        self, owner: UUID, attempts: Sequence[tuple[UUID, int]], conn: asyncpg.Connection
    ) -> set[tuple[UUID, int]]:
        """Renew the leases `owner` holds on these (task, attempt)s; returns those renewed."""
        if not attempts:
            return set()
        ids, numbers = (list(x) for x in zip(*attempts, strict=True))
        rows = await conn.fetch(RENEW_LEASES, owner, ids, numbers, self.lease_margin_s)
        return {(r["id"], r["attempt"]) for r in rows}

    async def release_leases(
        self, owner: UUID, attempts: Sequence[tuple[UUID, int]], conn: asyncpg.Connection
    ) -> None:
        """Give up the leases of attempts `owner` no longer runs (their processes are gone)."""
        if attempts:
            ids, numbers = (list(x) for x in zip(*attempts, strict=True))
            await conn.execute(RELEASE_LEASES, owner, ids, numbers)

    async def lease_overdue(self, limit: int, lease_s: float) -> list[tuple[Task, float]]:
        """Overdue Running attempts, each with the seconds since its lease was last renewed."""
        rows = await self.pool.fetch(LEASE_OVERDUE, limit, lease_s)
        return [(_task(row), float(row["_silent_s"] or 0.0)) for row in rows]

    async def grace(self, task_id: UUID, attempt: int) -> None:
        await self.pool.execute(GRACE_DEADLINE, task_id, attempt)

    async def restore(self, task_id: UUID, attempt: int) -> None:
        await self.pool.execute(RESTORE_DEADLINE, task_id, attempt, self.lease_margin_s)

    async def restart_deadlines(self) -> int:
        """Give every Running attempt a heartbeat timeout from now before it is judged."""
        status = await self.pool.execute(RESTART_DEADLINES, self.lease_margin_s)
        return int(status.split()[-1])

    async def next_deadline(self) -> tuple[float | None, float]:
        """(Seconds until the earliest deadline, or None; when Postgres started, epoch s)."""
        row = await self.pool.fetchrow(NEXT_DEADLINE)
        assert row is not None
        return row["wait_s"], row["started"]

    async def recover_lost(self, limit: int, plan: Any) -> list[Task]:
        """Move Lost tasks on, as `plan(task) -> Move` decides (SKIP LOCKED, shared)."""
        async with self.pool.acquire() as conn, conn.transaction():
            rows = await conn.fetch(CLAIM_LOST, limit)
            return await self.transition_many([plan(_task(r)) for r in rows], conn)

    async def requeue_stuck_scheduling(self, limit: int, older_than_s: float) -> list[Task]:
        """Attempts dispatched but not started within `older_than_s`: back to Ready."""
        async with self.pool.acquire() as conn, conn.transaction():
            rows = await conn.fetch(CLAIM_STUCK_SCHEDULING, limit, older_than_s)
            moves = [
                fsm.plan(_task(r), State.READY, f"not started within {older_than_s:g} s")
                for r in rows
            ]
            return await self.transition_many(moves, conn)

    async def record_late_results(
        self,
        results: Sequence[tuple[UUID, int, bool, Any, str | None, str]],
        conn: asyncpg.Connection | None = None,
    ) -> None:
        """Keep results of attempts that no longer own their task: recorded, never applied."""
        if not results:
            return
        cols = [list(x) for x in zip(*results, strict=True)]
        if conn is None:
            await self.pool.execute(RECORD_LATE_RESULTS, *cols)
        else:
            await conn.execute(RECORD_LATE_RESULTS, *cols)

    # -- workflows ------------------------------------------------------------------------------

    async def insert_workflow(
        self, conn: asyncpg.Connection, workflow_id: UUID, name: str, spec: dict[str, Any]
    ) -> bool:
        """Record a workflow; False if it exists already (a redelivered submission)."""
        return await conn.fetchval(INSERT_WORKFLOW, workflow_id, name, spec) is not None

    async def workflow_spec(self, conn: asyncpg.Connection, workflow_id: UUID) -> Any:
        """The spec a workflow was submitted with."""
        return await conn.fetchval(WORKFLOW_SPEC, workflow_id)

    async def insert_deps(
        self,
        conn: asyncpg.Connection,
        deps: Sequence[tuple[UUID, UUID, str, float | None, str, str | None]],
    ) -> None:
        """(task, upstream, condition, timeout_s, on_timeout, default as JSON text) rows."""
        if deps:
            await conn.execute(INSERT_DEPS, *(list(x) for x in zip(*deps, strict=True)))

    async def reprioritise(self, task: Task, priority: int) -> list[Task]:
        """Set `task`'s own priority and recompute the effective priorities it changes (for a
        workflow task: every task upstream of it inherits the highest downstream priority).
        Returns the tasks written: the task itself and each whose effective priority moved."""
        async with self.pool.acquire() as conn, conn.transaction():
            if task.workflow_id is None:
                effective = {task.id: priority}
            else:
                await conn.execute(LOCK_WORKFLOW_PRIORITIES, str(task.workflow_id))
                rows = await conn.fetch(WORKFLOW_PRIORITIES, task.workflow_id)
                ids = {r["wf_task"]: r["id"] for r in rows}
                names = {r["id"]: r["wf_task"] for r in rows}
                current = {r["id"]: r["priority"] for r in rows}
                own = {r["wf_task"]: r["own"] for r in rows}
                own[task.wf_task] = priority
                needs: dict[str, list[str]] = {name: [] for name in own}
                for edge in await conn.fetch(WORKFLOW_EDGES, task.workflow_id):
                    needs[names[edge["task_id"]]].append(names[edge["upstream_id"]])
                effective = {
                    ids[name]: p
                    for name, p in effective_priorities(own, needs).items()
                    if p != current[ids[name]] or ids[name] == task.id
                }
            rows = await conn.fetch(
                SET_PRIORITIES, list(effective), list(effective.values()), task.id, priority
            )
        return [_task(r) for r in rows]

    async def ended_with(
        self, conn: asyncpg.Connection, attempts: Sequence[tuple[UUID, int]], reason: str
    ) -> set[UUID]:
        """Of these (task id, version while Running), the tasks whose very next move left
        Running with `reason`: an end this writer already applied."""
        if not attempts:
            return set()
        ids, versions = (list(x) for x in zip(*attempts, strict=True))
        return {r["task_id"] for r in await conn.fetch(ENDED_WITH, ids, versions, reason)}

    async def mark_timed_out(
        self, conn: asyncpg.Connection, edges: Sequence[tuple[UUID, UUID]]
    ) -> None:
        if edges:
            await conn.execute(MARK_TIMED_OUT, *(list(x) for x in zip(*edges, strict=True)))

    async def downstream_of(self, upstream_ids: Sequence[UUID]) -> list[UUID]:
        rows = await self.pool.fetch(DOWNSTREAM_OF, list(upstream_ids))
        return [r["task_id"] for r in rows]

    async def pending_with_deps(self, limit: int) -> list[UUID]:
        return [r["task_id"] for r in await self.pool.fetch(PENDING_WITH_DEPS, limit)]

    async def lock_pending(self, conn: asyncpg.Connection, ids: Sequence[UUID]) -> list[Task]:
        return [_task(r) for r in await conn.fetch(LOCK_PENDING, list(ids))]

    async def edges_of(self, conn: asyncpg.Connection, ids: Sequence[UUID]) -> list[asyncpg.Record]:
        return list(await conn.fetch(EDGES_OF, list(ids)))

    async def resources_held(
        self, conn: asyncpg.Connection, workflow_ids: Sequence[UUID]
    ) -> dict[tuple[UUID, str], tuple[int, int]]:
        """{(workflow, resource): (held, capacity)} for these workflows."""
        if not workflow_ids:
            return {}
        rows = await conn.fetch(RESOURCES_HELD, list(workflow_ids))
        return {(r["workflow_id"], r["name"]): (r["held"], r["capacity"]) for r in rows}

    async def has_deps(self, task_id: UUID) -> bool:
        return bool(await self.pool.fetchval(HAS_DEPS, task_id))

    async def workflow(
        self, workflow_id: UUID
    ) -> tuple[asyncpg.Record, list[Task], list[asyncpg.Record]]:
        row = await self.pool.fetchrow(GET_WORKFLOW, workflow_id)
        if row is None:
            raise NotFound(f"no workflow {workflow_id}")
        tasks = [_task(r) for r in await self.pool.fetch(WORKFLOW_TASKS, workflow_id)]
        edges = list(await self.pool.fetch(WORKFLOW_EDGES, workflow_id))
        return row, tasks, edges

    async def next_retry_due(self) -> float | None:
        """Seconds until the earliest retry is due (Postgres time); None if none waits."""
        due: float | None = await self.pool.fetchval(NEXT_RETRY_DUE)
        return due

    async def history(self, task_id: UUID) -> list[Event]:
        rows = await self.pool.fetch(HISTORY, task_id)
        if not rows:
            await self.get(task_id)  # raises NotFound for an unknown id
        return [_event(row) for row in rows]
