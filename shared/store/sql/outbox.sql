-- The outbox: task_events not yet published, drained by relays shard by shard.

-- name: lock_free_shards
-- The shards no other relay is draining now (one relay per shard keeps each task's events in
-- version order).
SELECT shard FROM outbox_shards ORDER BY shard FOR UPDATE SKIP LOCKED

-- name: unpublished
-- The oldest unpublished events of these shards, each rendered as the JSON of models.Event by
-- Postgres: the relay only concatenates, a few microseconds of its CPU per event.
SELECT id, task_id, to_status, body FROM sked_unpublished($1::smallint[], $2::int)

-- name: define_unpublished
-- The read behind `unpublished`, as a function so that it always walks the partial index
-- task_events_unpublished with a plain index scan. Every marked event leaves a dead entry in
-- that index until a vacuum; a plain index scan marks the entries it finds dead so that later
-- scans skip them, while a bitmap scan (which a planner working from a young table's
-- statistics picks) or a sequential scan visits every one again, on every pass: 10-13 ms a
-- pass late in a burst of 5,000 tasks, against well under one.
CREATE OR REPLACE FUNCTION sked_unpublished(smallint[], int)
RETURNS TABLE (id bigint, task_id uuid, to_status text, body text)
LANGUAGE sql STABLE
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $fn$
SELECT id, task_id, to_status,
       json_build_object('id', id, 'task_id', task_id, 'from_status', from_status,
                         'to_status', to_status, 'version', version, 'attempt', attempt,
                         'reason', reason, 'at', at)::text
FROM task_events
WHERE published_at IS NULL AND shard = ANY($1)
ORDER BY id
LIMIT $2
$fn$

-- name: mark_published
-- These events went out (confirmed by the broker).
UPDATE task_events SET published_at = now() WHERE id = ANY($1::bigint[])
