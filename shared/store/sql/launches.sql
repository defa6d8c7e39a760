-- Launches: the object (a Kubernetes Job) each attempt runs as, recorded once it exists.

-- name: record_launch
-- Record an attempt's object; recording the same one again changes nothing.
INSERT INTO launches (task_id, attempt, name, uid, executor)
VALUES ($1, $2, $3, $4, $5)
ON CONFLICT (task_id, attempt) DO NOTHING

-- name: launch_uid
-- The uid recorded for an attempt's object (no row: never launched).
SELECT uid FROM launches WHERE task_id = $1 AND attempt = $2

-- name: launched_by
-- The attempts an executor launched whose task is still Running in that attempt: what it
-- follows again after a restart.
SELECT l.task_id, l.attempt FROM launches l
JOIN tasks t ON t.id = l.task_id AND t.attempt = l.attempt AND t.status = 'running'
WHERE l.executor = $1
