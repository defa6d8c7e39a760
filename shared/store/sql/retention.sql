-- Retention: finished tasks deleted once they ended longer ago than the retention, by Postgres
-- time (SKED_RETENTION_DAYS; services/recovery). A task's history goes with it (task_events
-- has no foreign key: 0015), and its late results, launches and edges by their cascades. Rows
-- another statement holds are passed over (SKIP LOCKED): recovery's replicas share the work.

-- fragment: ended_before(cutoff)
-- The task has ended for good before `cutoff`: terminal (fsm.is_terminal in SQL, as
-- terminal_among) and finished then. NULL for a task never finished: negate with IS NOT TRUE.
(t.finished_at < {{cutoff}} AND {{has_ended(t.)}})

-- fragment: remember(rows)
-- A tombstone for each (id, created_at) deleted (table purged, 0018): a later read or wait
-- says so, and a page of a listing after it goes on from where it stood (0022). An id can be
-- deleted twice (a task's id comes from its idempotency key, which is free again once it is
-- deleted): the tombstone then tells the later time.
INSERT INTO purged (id, created_at)
SELECT DISTINCT ON (id) id, created_at FROM ({{rows}}) AS deleted
ON CONFLICT (id) DO UPDATE SET purged_at = now(), created_at = EXCLUDED.created_at

-- name: purge_tasks
-- Up to $1 tasks outside any workflow that ended $2 seconds ago or longer, oldest first,
-- deleted with their history. Returns the ids deleted. A workflow's tasks stay until the whole
-- workflow goes (purge_workflows): a task Pending downstream reads its upstreams' results, and
-- an edge deleted with its upstream would release it without them.
WITH doomed AS (
    SELECT t.id, t.created_at FROM tasks t
    WHERE t.workflow_id IS NULL
      AND t.status IN ({{terminal_states}}, {{retryable_states}})  -- tasks_ended_alone
      AND {{ended_before(now() - make_interval(secs => $2))}}
    ORDER BY t.finished_at
    LIMIT $1
    FOR UPDATE OF t SKIP LOCKED
), history AS (
    DELETE FROM task_events e USING doomed d WHERE e.task_id = d.id
), remembered AS (
    {{remember(SELECT id, created_at FROM doomed)}}
)
DELETE FROM tasks t USING doomed d WHERE t.id = d.id
RETURNING t.id

-- name: purge_workflows
-- Of the oldest $3 workflows whose every task ended $2 seconds ago or longer (those another
-- statement holds passed over), the first ones whose tasks add up to $1 at most, deleted
-- whole: the workflow's row, and by cascade its tasks and their edges, late results and
-- launches; their history with them. A statement's work is bounded by tasks, not workflows: a
-- workflow may hold 100,000. Returns (workflows, tasks) deleted; `oversize`, the oldest
-- candidate when it alone holds more than $1 tasks (deleted in chunks instead:
-- lock_workflow_purge); and `more`, whether candidates were left over.
WITH candidate AS (
    SELECT w.id, w.created_at FROM workflows w
    WHERE w.created_at < now() - make_interval(secs => $2)
      AND NOT EXISTS (
          SELECT 1 FROM tasks t
          WHERE t.workflow_id = w.id
            AND {{ended_before(now() - make_interval(secs => $2))}} IS NOT TRUE)
    ORDER BY w.created_at, w.id
    LIMIT $3
    FOR UPDATE OF w SKIP LOCKED
), sized AS (
    SELECT c.id, c.created_at, n.tasks,
           sum(n.tasks) OVER (ORDER BY c.created_at, c.id) AS running,
           row_number() OVER (ORDER BY c.created_at, c.id) AS nth
    FROM candidate c
    CROSS JOIN LATERAL (
        SELECT count(*) AS tasks FROM tasks t WHERE t.workflow_id = c.id  -- tasks_workflow
    ) n
), doomed AS (
    SELECT id, created_at FROM sized WHERE running <= $1
), members AS (
    SELECT t.id, t.created_at FROM tasks t JOIN doomed d ON t.workflow_id = d.id
), history AS (
    DELETE FROM task_events e USING members m WHERE e.task_id = m.id
), remembered AS (
    {{remember(SELECT id, created_at FROM members UNION ALL SELECT id, created_at FROM doomed)}}
), gone AS (
    DELETE FROM workflows w USING doomed d WHERE w.id = d.id
    RETURNING w.id
)
SELECT (SELECT count(*) FROM gone) AS workflows, (SELECT count(*) FROM members) AS tasks,
       (SELECT id FROM sized WHERE nth = 1 AND tasks > $1) AS oversize,
       (SELECT count(*) FROM sized) > (SELECT count(*) FROM gone)
       OR (SELECT count(*) FROM sized) = $3 AS more

-- name: lock_workflow_purge
-- Workflow $1, locked for its deletion in chunks (purge_workflow_tasks, then
-- purge_workflow_row, in this one transaction) if every task of it still ended $2 seconds
-- ago or longer, and no other replica holds it. Its members' ids in id order (the order
-- other writers lock tasks in; a workflow's are at most 100,000), or no row. The lock keeps
-- new tasks out of it (their foreign key's KEY SHARE waits), and readers see it whole until
-- the transaction commits.
SELECT array(SELECT t.id FROM tasks t WHERE t.workflow_id = w.id ORDER BY t.id) AS members
FROM workflows w
WHERE w.id = $1
  AND w.created_at < now() - make_interval(secs => $2)
  AND NOT EXISTS (
      SELECT 1 FROM tasks t
      WHERE t.workflow_id = w.id
        AND {{ended_before(now() - make_interval(secs => $2))}} IS NOT TRUE)
FOR UPDATE OF w SKIP LOCKED

-- name: purge_workflow_tasks
-- A chunk of a locked workflow's tasks ($1, ids from lock_workflow_purge), deleted with their
-- history (edges, late results and launches by cascade). Returns how many.
WITH doomed AS (
    SELECT t.id, t.created_at FROM tasks t WHERE t.id = ANY($1::uuid[])
), history AS (
    DELETE FROM task_events e USING doomed d WHERE e.task_id = d.id
), remembered AS (
    {{remember(SELECT id, created_at FROM doomed)}}
), gone AS (
    DELETE FROM tasks t USING doomed d WHERE t.id = d.id
    RETURNING 1
)
SELECT count(*) FROM gone

-- name: purge_workflow_row
-- The row of a workflow whose tasks purge_workflow_tasks deleted, deleted, its id remembered.
-- Returns how many (1, or 0 for a workflow that is gone).
WITH gone AS (
    DELETE FROM workflows w WHERE w.id = $1
    RETURNING w.id, w.created_at
), remembered AS (
    {{remember(SELECT id, created_at FROM gone)}}
)
SELECT count(*) FROM gone

-- name: purge_audit
-- Up to $1 of the operator API's audit rows recorded $2 seconds ago or longer, oldest first,
-- deleted (SKED_AUDIT_RETENTION_DAYS). Returns how many. Rows another replica's statement
-- holds are passed over.
WITH doomed AS (
    SELECT a.id FROM api_audit a
    WHERE a.at < now() - make_interval(secs => $2)  -- api_audit_at
    ORDER BY a.at
    LIMIT $1
    FOR UPDATE SKIP LOCKED
), gone AS (
    DELETE FROM api_audit a USING doomed d WHERE a.id = d.id
    RETURNING 1
)
SELECT count(*) FROM gone

-- name: purge_tombstones
-- Up to $1 tombstones (purged) of ids deleted $2 seconds ago or longer, deleted: past that a
-- read of such an id answers as for one never admitted. Returns how many.
WITH doomed AS (
    SELECT p.id FROM purged p
    WHERE p.purged_at < now() - make_interval(secs => $2)  -- purged_at
    ORDER BY p.purged_at
    LIMIT $1
    FOR UPDATE SKIP LOCKED
), gone AS (
    DELETE FROM purged p USING doomed d WHERE p.id = d.id
    RETURNING 1
)
SELECT count(*) FROM gone

-- name: tasks_purged
-- Of these task ids, those retention deleted (and still remembers) with no task of that id
-- since (one with the same idempotency key), with when.
SELECT p.id, p.purged_at FROM purged p
WHERE p.id = ANY($1::uuid[]) AND NOT EXISTS (SELECT 1 FROM tasks t WHERE t.id = p.id)

-- name: purged_when
-- When retention deleted this id (a task's or a workflow's), if it still remembers.
SELECT purged_at FROM purged WHERE id = $1::uuid

-- name: purged_when_text
-- The same as text (the CLI's synchronous read: shared.store.quick).
SELECT purged_at::text FROM purged WHERE id = $1::uuid
