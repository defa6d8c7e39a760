-- Leases and heartbeats: what keeps a Running attempt from being declared Lost, and what the
-- heartbeat-monitor's sweep reads. None of these is a state change (no version, no event).

-- name: renew_leases
-- An executor ($1: its incarnation) renews the leases of the attempts it runs: only a task
-- still Running in that attempt under that owner. The rows `renewed` are its proof that
-- Postgres holds each lease a heartbeat timeout from now. A row another transaction holds is
-- passed over, not waited for (one held row must not hold back every renewal of the node):
-- returned `renewed` false when, as last committed, it is still Running under this lease (not
-- renewed this time, not refused); a row not returned is refused. $4: the lease margin.
WITH u AS (SELECT * FROM unnest($2::uuid[], $3::int[]) AS u(id, attempt)),
locked AS (
    {{skip_locked_in_id_order(t.status = 'running' AND t.attempt = u.attempt AND t.lease_owner = $1)}}
),
renewed AS (
    UPDATE tasks t SET
        lease_until = greatest(t.lease_until,
                               now() + make_interval(secs => t.heartbeat_timeout_s)),
        hb_deadline = greatest(t.hb_deadline,
                               now() + make_interval(secs => t.heartbeat_timeout_s + $4))
    FROM locked u
    WHERE t.id = u.id AND t.status = 'running' AND t.attempt = u.attempt AND t.lease_owner = $1
    RETURNING t.id, t.attempt
)
SELECT id, attempt, true AS renewed FROM renewed
UNION ALL
SELECT u.id, u.attempt, false FROM u JOIN tasks t ON t.id = u.id
WHERE t.status = 'running' AND t.attempt = u.attempt AND t.lease_owner = $1
  AND NOT EXISTS (SELECT 1 FROM locked l WHERE l.id = u.id AND l.attempt = u.attempt)

-- name: release_leases
-- An executor gives up the leases of attempts it no longer runs (paused or canceled, their
-- processes gone), so that a next attempt need not wait for them to lapse. Never the lease of
-- an attempt still Running. A lease given back frees its node's slot and lets a resumed task
-- start: the schedulers are told (NOTIFY sked_task, the tasks as they stand, no move).
WITH u AS (SELECT * FROM unnest($2::uuid[], $3::int[]) AS u(id, attempt)),
locked AS (
    {{locked_in_id_order(t.lease_owner = $1 AND t.lease_attempt = u.attempt AND NOT (t.status = 'running' AND t.attempt = u.attempt))}}
), released AS (
    UPDATE tasks t SET lease_owner = NULL, lease_attempt = NULL, lease_until = NULL
    FROM locked u
    WHERE t.id = u.id AND t.lease_owner = $1 AND t.lease_attempt = u.attempt
      AND NOT (t.status = 'running' AND t.attempt = u.attempt)
    RETURNING t.id, t.version, t.schedule_deadline, t.workflow_id, t.status
)
SELECT pg_notify('sked_task', {{task_payload}}) FROM released HAVING count(*) > 0

-- name: apply_heartbeats
-- Beats (task, attempt, seq), applied only to the attempt Running now and only when newer
-- than the last applied: a beat of an older attempt, or a replay, changes nothing. A beat
-- pushes the monitor's deadline; it never extends a lease.
WITH u AS (SELECT * FROM unnest($1::uuid[], $2::int[], $3::bigint[]) AS u(id, attempt, seq)),
locked AS (
    {{locked_in_id_order(t.status = 'running' AND t.attempt = u.attempt AND u.seq > t.hb_seq)}}
)
UPDATE tasks t SET hb_seq = u.seq, hb_at = now(),
                   hb_deadline = greatest(t.hb_deadline,
                                          now() + make_interval(secs => t.heartbeat_timeout_s))
FROM locked u
WHERE t.id = u.id AND t.status = 'running' AND t.attempt = u.attempt AND u.seq > t.hb_seq
RETURNING t.id, t.attempt

-- name: lease_overdue
-- The heartbeat-monitor's sweep: overdue Running attempts, leased to this monitor for $2
-- seconds (the deadline moves on) so that replicas never judge one at once. `_silent_s`: how
-- long ago the attempt's lease was last renewed, by Postgres's clock.
WITH due AS (
    SELECT id FROM tasks
    WHERE status = 'running' AND hb_deadline < now()
    ORDER BY hb_deadline
    LIMIT $1
    FOR UPDATE SKIP LOCKED
)
UPDATE tasks t SET hb_deadline = now() + make_interval(secs => $2)
FROM due WHERE t.id = due.id
RETURNING {{task_columns(t.)}},
    extract(epoch FROM now() - COALESCE(
        t.lease_until - make_interval(secs => t.heartbeat_timeout_s), t.hb_at, t.started_at
    ))::float8 AS _silent_s

-- name: grace_deadline
-- The ladder's grace: look again when twice the timeout has passed since the last renewal.
UPDATE tasks SET hb_deadline = COALESCE(lease_until, hb_at, now())
                               + make_interval(secs => heartbeat_timeout_s)
WHERE id = $1 AND attempt = $2 AND status = 'running'

-- name: restore_deadline
-- The ladder's restore: the backend says the attempt runs; look again a timeout from now.
UPDATE tasks SET hb_deadline = now() + make_interval(secs => heartbeat_timeout_s + $3)
WHERE id = $1 AND attempt = $2 AND status = 'running'

-- name: restart_deadlines
-- After an outage (or when a monitor starts), no deadline is judged before the executors had
-- a heartbeat timeout to renew: the time they could not reach Postgres is not held against them.
UPDATE tasks SET hb_deadline = greatest(hb_deadline,
                                        now() + make_interval(secs => heartbeat_timeout_s + $1))
WHERE status = 'running'

-- name: next_deadline
-- Seconds until the earliest deadline (Postgres's clock), and when this Postgres started: a
-- restart since the monitor last looked is an outage it slept through.
SELECT (SELECT extract(epoch FROM min(hb_deadline) - now())::float8
        FROM tasks WHERE status = 'running') AS wait_s,
       extract(epoch FROM pg_postmaster_start_time())::float8 AS started

-- name: adopt_leases
-- An executor ($1: its incarnation) takes over the leases of attempts still Running whose
-- object it can follow (a Kubernetes Job runs on without the executor that created it): from
-- now on it renews them and reports their outcomes. Returns the tasks adopted. $5, if not
-- null: only attempts placed on that node (a local executor's records of a dead predecessor
-- lie in a directory its tasks may write: they must not name another node's attempts).
WITH u AS (SELECT * FROM unnest($2::uuid[], $3::int[]) AS u(id, attempt)),
locked AS (
    {{locked_in_id_order(t.status = 'running' AND t.attempt = u.attempt AND ($5::text IS NULL OR t.node = $5::text))}}
)
UPDATE tasks t SET
    lease_owner = $1, lease_attempt = t.attempt,
    lease_until = greatest(t.lease_until, now() + make_interval(secs => t.heartbeat_timeout_s)),
    hb_deadline = greatest(t.hb_deadline,
                           now() + make_interval(secs => t.heartbeat_timeout_s + $4))
FROM locked u
WHERE t.id = u.id AND t.status = 'running' AND t.attempt = u.attempt
  AND ($5::text IS NULL OR t.node = $5::text)
RETURNING {{task_columns(t.)}}
