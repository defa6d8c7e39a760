-- Late results: outcomes of attempts that no longer owned their task. Kept, never applied.

-- name: record_late_results
-- (task, attempt, ok, result, error, note) rows.
INSERT INTO late_results (task_id, attempt, ok, result, error, note)
SELECT * FROM unnest($1::uuid[], $2::int[], $3::bool[], $4::jsonb[], $5::text[], $6::text[])
