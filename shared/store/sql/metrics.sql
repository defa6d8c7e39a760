-- The cluster-wide gauges of shared/metrics.py: computed by one process per deployment, the
-- one whose connection holds the advisory lock below.

-- name: lead_gauges
-- Whether this connection computes the cluster-wide gauges: a session-level advisory lock,
-- taken without waiting and held for as long as the connection lives. A process that dies,
-- or whose connection drops, releases it; another takes it at its next try.
SELECT pg_try_advisory_lock(hashtext('sked:metrics:cluster'))

-- name: resign_gauges
-- Give the gauges' lock up (pooled connections are not reset on release: shared/store/db.py).
SELECT pg_advisory_unlock(hashtext('sked:metrics:cluster'))

-- name: cluster_gauges
-- The cluster-wide gauges in one statement: the tasks in each of the states $1 (those work
-- passes through: final states grow without bound and are read as rates of
-- sked_transitions_total), the events not yet published, and the age of the oldest of them
-- by Postgres's clock (0: none).
WITH by_state AS (
    SELECT status, count(*) AS n FROM tasks WHERE status = ANY($1::text[]) GROUP BY status
)
SELECT ARRAY(SELECT status FROM by_state) AS states,
       ARRAY(SELECT n FROM by_state) AS counts,
       (SELECT count(*) FROM outbox) AS outbox_backlog,
       -- the oldest by id: ids follow commit time closely enough for a gauge, and this reads
       -- one row of the primary key where min(at) would read the whole backlog
       COALESCE((SELECT EXTRACT(EPOCH FROM now() - at) FROM outbox ORDER BY id LIMIT 1),
                0)::float8 AS relay_lag_s
