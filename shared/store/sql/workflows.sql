-- Workflows: the DAG as stored, its edges, and what decides a task downstream.

-- name: insert_workflow
-- Record a workflow; nothing if one with this id exists (a redelivered submission), or
-- existed and retention deleted it (its tombstone, 0018): the id is its submission's message
-- id, so the same id is that submission again, already run, not a new one.
INSERT INTO workflows (id, name, spec)
SELECT $1, $2, $3::jsonb WHERE NOT EXISTS (SELECT 1 FROM purged WHERE id = $1)
ON CONFLICT (id) DO NOTHING
RETURNING id

-- name: workflow_spec
-- The spec a workflow was submitted with.
SELECT spec FROM workflows WHERE id = $1

-- name: insert_deps
-- Edges: (task, upstream, condition, timeout_s, on_timeout, default as JSON text) rows.
INSERT INTO task_deps (task_id, upstream_id, condition, timeout_s, on_timeout, default_value)
SELECT u.task_id, u.upstream_id, u.condition, u.timeout_s, u.on_timeout, u.dflt::jsonb
FROM unnest($1::uuid[], $2::uuid[], $3::text[], $4::float8[], $5::text[], $6::text[])
     AS u(task_id, upstream_id, condition, timeout_s, on_timeout, dflt)
ON CONFLICT DO NOTHING

-- name: downstream_of
-- The tasks that depend on any of these.
SELECT DISTINCT task_id FROM task_deps WHERE upstream_id = ANY($1::uuid[])

-- name: lock_pending
-- The downstream tasks to decide, locked in id order: a second decider waits here, then
-- finds them decided.
SELECT {{task_columns()}} FROM tasks
WHERE id = ANY($1::uuid[]) AND status = 'pending'
ORDER BY id
FOR UPDATE

-- name: edges_of
-- Every edge into these tasks, with the upstream's state and whether the wait for it has
-- passed its timeout (measured from when the task last entered Pending). In seconds, not as
-- updated_at + timeout: no stored timeout can overflow a timestamp. Not the upstream's
-- output: a pass that releases nothing read every finished upstream's (upstream_results
-- reads them for the tasks released alone).
SELECT d.task_id, d.upstream_id, d.condition, u.status, u.retry_count, u.max_retries,
       d.timeout_s, d.on_timeout, d.timed_out_at, d.default_value, u.wf_task AS upstream_name,
       u.kind AS upstream_kind,
       extract(epoch FROM now() - t.updated_at) >= d.timeout_s AS overdue
FROM task_deps d JOIN tasks u ON u.id = d.upstream_id JOIN tasks t ON t.id = d.task_id
WHERE d.task_id = ANY($1::uuid[])

-- name: inputs_sizes
-- For tasks about to be released: the bytes of what their succeeded upstreams hand them
-- (shared.dag.output_of: a command's declared output, a handler's result) as Postgres writes
-- its JSON, which is at least about its compact size: the resolver reads the outputs in
-- batches of bounded bytes, and the exact check follows.
SELECT d.task_id,
       coalesce(sum(octet_length(
           (CASE WHEN u.kind = 'command' THEN u.result -> 'output' ELSE u.result END)::text
       )), 0)::bigint AS bytes
FROM task_deps d JOIN tasks u ON u.id = d.upstream_id
WHERE d.task_id = ANY($1::uuid[]) AND u.status = 'success'
GROUP BY d.task_id

-- name: upstream_results
-- The results of these tasks' succeeded upstreams (what they hand on: shared.dag.output_of).
SELECT d.task_id, d.upstream_id, u.result
FROM task_deps d JOIN tasks u ON u.id = d.upstream_id
WHERE d.task_id = ANY($1::uuid[]) AND u.status = 'success'

-- name: mark_timed_out
-- Record that these (task, upstream) waits timed out (each once).
UPDATE task_deps SET timed_out_at = now()
FROM unnest($1::uuid[], $2::uuid[]) AS u(task_id, upstream_id)
WHERE task_deps.task_id = u.task_id AND task_deps.upstream_id = u.upstream_id
  AND task_deps.timed_out_at IS NULL

-- name: pending_with_deps
-- Up to $1 Pending tasks that wait for upstreams, in id order, after task $2 when given (the
-- resolver's periodic sweep pages through them all along task_deps' key).
SELECT DISTINCT d.task_id FROM task_deps d JOIN tasks t ON t.id = d.task_id
WHERE t.status = 'pending' AND ($2::uuid IS NULL OR d.task_id > $2::uuid)
ORDER BY d.task_id
LIMIT $1

-- name: get_workflow
-- A workflow's row.
SELECT id, name, spec::text AS spec, created_at FROM workflows WHERE id = $1

-- name: workflow_tasks
-- A workflow's tasks, by name.
SELECT {{task_columns()}} FROM tasks WHERE workflow_id = $1 ORDER BY wf_task

-- name: lock_open_tasks
-- A workflow's tasks that have not ended (terminal_among's test, negated), locked in id order,
-- with only what a move needs of them (fsm.TaskView): control of a whole workflow moves them
-- all in one transaction, and never reads a finished task's result or log.
SELECT id, status, version, attempt, retry_count, max_retries, launch_failures,
       max_launch_failures
FROM tasks
WHERE workflow_id = $1
  AND NOT {{has_ended()}}
ORDER BY id
FOR UPDATE

-- name: workflow_edges
-- A workflow's edges (task, upstream, condition).
SELECT d.task_id, d.upstream_id, d.condition
FROM task_deps d JOIN tasks t ON t.id = d.task_id
WHERE t.workflow_id = $1

-- name: has_deps
-- Whether a task waits for upstreams.
SELECT EXISTS (SELECT 1 FROM task_deps WHERE task_id = $1)

-- name: lock_workflows
-- Placement's lock on the workflows whose named resources it counts, in id order. NO KEY:
-- a task inserted under one (its foreign key's KEY SHARE) does not wait for it.
SELECT id FROM workflows WHERE id = ANY($1::uuid[]) ORDER BY id FOR NO KEY UPDATE

-- name: resources_held
-- Each named resource of these workflows: its capacity, and how many units its tasks in
-- Scheduling or Running (or running on past a pause or cancel: holds_slot) hold now. Read
-- under the placement locks, so it is current. A capacity past an int (stored before
-- dag.MAX_CAPACITY bounded it) reads as the int's most.
SELECT w.id AS workflow_id, r.name, LEAST(r.capacity::numeric, 2147483647)::int AS capacity,
       (SELECT count(*) FROM tasks t
        WHERE t.workflow_id = w.id AND {{holds_slot}}
          AND r.name = ANY(t.uses)) AS held
FROM workflows w, jsonb_each_text(w.spec -> 'resources') AS r(name, capacity)
WHERE w.id = ANY($1::uuid[])

-- name: list_workflows
-- Workflows newest first (created_at descending, then id), optionally of one name ($1), at
-- most $2; with $3, those after workflow $3 in that order (keyset paging, as list_tasks: an
-- unknown $3 yields no rows, a deleted one goes on from its tombstone). Each with its tasks
-- counted by state and how many have not ended (terminal_among's test), read for the page's
-- workflows alone through tasks_workflow.
WITH c AS (
    SELECT created_at, id FROM workflows WHERE id = $3
    UNION ALL  -- deleted by retention since: where it stood, from its tombstone (0022)
    SELECT created_at, id FROM purged WHERE id = $3 AND created_at IS NOT NULL
    LIMIT 1
),
page AS (
    SELECT w.id, w.name, w.created_at FROM workflows w
    WHERE ($1::text IS NULL OR w.name = $1)
      AND w.created_at <= coalesce((SELECT created_at FROM c), 'infinity')
      AND ($3::uuid IS NULL
           OR w.created_at < (SELECT created_at FROM c)
           OR w.id > (SELECT id FROM c))
      AND ($3::uuid IS NULL OR EXISTS (SELECT FROM c))
    ORDER BY w.created_at DESC, w.id
    LIMIT $2
)
SELECT p.id, p.name, p.created_at,
       coalesce(k.counts, '{}'::jsonb) AS counts, coalesce(k.open, 0) AS open
FROM page p
LEFT JOIN LATERAL (
    SELECT jsonb_object_agg(s.status, s.n) AS counts, sum(s.open) AS open
    FROM (
        SELECT t.status, count(*) AS n,
               count(*) FILTER (WHERE NOT {{has_ended(t.)}}) AS open
        FROM tasks t WHERE t.workflow_id = p.id GROUP BY t.status
    ) s
) k ON true
ORDER BY p.created_at DESC, p.id

-- name: workflow_exists
-- Whether workflow $1 exists (an empty page after it: unknown, or the last page).
SELECT EXISTS (SELECT FROM workflows WHERE id = $1)

-- name: workflow_cursor_known
-- Whether a listing can page after workflow $1: it exists, or retention deleted it and its
-- tombstone tells where it stood (an empty page after it: unknown, or the last page).
SELECT EXISTS (SELECT FROM workflows WHERE id = $1)
       OR EXISTS (SELECT FROM purged WHERE id = $1 AND created_at IS NOT NULL)
