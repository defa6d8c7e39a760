-- Degrade modes: the one row every scheduler obeys, the automatic evaluator's inputs.

-- name: read_degrade
-- The mode row, with the seconds left until its end by Postgres's clock (NULL: no end) and
-- those since its cause was seen gone (NULL: not gone).
SELECT mode, automatic, reason, set_by, since, until, version,
       EXTRACT(EPOCH FROM until - now())::float8 AS remaining_s,
       EXTRACT(EPOCH FROM now() - calm_since)::float8 AS calm_s
FROM degrade

-- name: mark_calm
-- The evaluator saw an automatic mode's cause gone ($1 true: from now, unless already) or
-- holding ($1 false), if the row is still at version $2; no write when nothing changes.
UPDATE degrade SET calm_since = CASE WHEN $1 THEN now() END
WHERE version = $2 AND (calm_since IS NULL) = $1

-- name: set_degrade
-- Change the mode if the row is still at version $6 (CAS): $5 seconds from now, or no end;
-- tell every scheduler (NOTIFY sked_degrade).
WITH up AS (
    UPDATE degrade SET
        mode = $1, automatic = $2, reason = $3, set_by = $4, since = now(),
        until = CASE WHEN $5::float8 IS NULL THEN NULL
                     ELSE now() + make_interval(secs => $5::float8) END,
        version = version + 1, calm_since = NULL
    WHERE version = $6
    RETURNING mode, automatic, reason, set_by, since, until, version,
              EXTRACT(EPOCH FROM until - now())::float8 AS remaining_s,
              NULL::float8 AS calm_s
), note AS (SELECT pg_notify('sked_degrade', mode) FROM up)
SELECT up.*, (SELECT count(*) FROM note) AS _notified FROM up

-- name: lead_degrade
-- One scheduler at a time evaluates the automatic triggers: a transaction-scoped advisory
-- lock (released at COMMIT), taken without waiting — whoever holds it evaluates now.
SELECT pg_try_advisory_xact_lock(hashtext('sked:degrade'))

-- name: degrade_snapshot
-- What the triggers look at, in one statement: nodes seen within $2 seconds and which of
-- them are healthy (ready, heartbeat within $1 seconds), their GPUs and those held, the tasks
-- waiting, the outbox backlog; and Postgres's now() (alerts carry its time). A node whose
-- executor stopped cleanly (left_at) is not counted: it was not lost. Of the nodes $3 the
-- evaluator holds lost: those healthy again (`back`), and those that left cleanly or were
-- forgotten (`departed`); one only gone quiet past $2 seconds is neither, still lost. Sums
-- are bigint: each node's GPUs may be up to 2^31 - 1, and two such overflowed an int.
WITH n AS (
    SELECT id, gpu, ready AND heartbeat_at > now() - make_interval(secs => $1) AS healthy
    FROM nodes WHERE heartbeat_at > now() - make_interval(secs => $2) AND left_at IS NULL
)
SELECT (SELECT count(*) FROM n) AS nodes_total,
       (SELECT count(*) FROM n WHERE healthy) AS nodes_healthy,
       (SELECT COALESCE(sum(gpu), 0) FROM n WHERE healthy)::bigint AS gpu_total,
       (SELECT COALESCE(sum(t.gpu), 0) FROM tasks t JOIN n ON n.id = t.node AND n.healthy
        WHERE {{holds_slot}})::bigint AS gpu_used,
       (SELECT count(*) FROM tasks WHERE status = 'ready') AS waiting,
       (SELECT count(*) FROM outbox) AS outbox_backlog,
       ARRAY(SELECT id FROM n WHERE NOT healthy ORDER BY id) AS unhealthy,
       ARRAY(SELECT id FROM n WHERE healthy AND id = ANY($3::text[]) ORDER BY id) AS back,
       ARRAY(SELECT d.id FROM unnest($3::text[]) AS d(id)
             WHERE NOT EXISTS (SELECT FROM nodes x WHERE x.id = d.id AND x.left_at IS NULL)
             ORDER BY d.id) AS departed,
       now() AS at

-- name: ready_at_least
-- Partial mode's candidates: Ready tasks at or above priority $1, highest first, oldest first
-- within a priority (index tasks_runnable), at most $2; with $3-$5, those after the task of
-- that (priority, queued_at, id) in this order: the passes take turns through them, so tasks
-- that cannot be placed yet do not take every pass's batch from those behind that could.
SELECT id, priority, queued_at FROM tasks
WHERE status = 'ready' AND priority >= $1
  AND ($3::int IS NULL
       OR priority < $3::int
       OR (priority = $3::int AND (queued_at, id) > ($4::timestamptz, $5::uuid)))
ORDER BY priority DESC, queued_at, id
LIMIT $2
