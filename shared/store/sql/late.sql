-- Late results: outcomes of attempts that no longer owned their task. Kept, never applied.

-- name: record_late_results
-- (task, attempt, ok, result, error, note) rows; those of a task retention deleted meanwhile
-- are dropped (the lock waits out a delete in flight, then finds no row), not an error; an
-- attempt recorded already (a write retried after its COMMIT went through) is not again.
INSERT INTO late_results (task_id, attempt, ok, result, error, note)
SELECT u.* FROM unnest($1::uuid[], $2::int[], $3::bool[], $4::jsonb[], $5::text[], $6::text[])
    AS u (task_id, attempt, ok, result, error, note)
WHERE EXISTS (SELECT 1 FROM tasks t WHERE t.id = u.task_id FOR KEY SHARE OF t)
ON CONFLICT (task_id, attempt) DO NOTHING
