-- The outbox: task_events not yet published, drained by relays shard by shard.

-- name: lock_free_shards
-- The shards no other relay is draining now (one relay per shard keeps each task's events in
-- version order).
SELECT shard FROM outbox_shards ORDER BY shard FOR UPDATE SKIP LOCKED

-- name: unpublished
-- The oldest unpublished events of these shards, each rendered as the JSON of models.Event by
-- Postgres: the relay only concatenates, a few microseconds of its CPU per event.
SELECT id, task_id, to_status,
       json_build_object('id', id, 'task_id', task_id, 'from_status', from_status,
                         'to_status', to_status, 'version', version, 'attempt', attempt,
                         'reason', reason, 'at', at)::text AS body
FROM task_events
WHERE published_at IS NULL AND shard = ANY($1::smallint[])
ORDER BY id
LIMIT $2

-- name: mark_published
-- These events went out (confirmed by the broker).
UPDATE task_events SET published_at = now() WHERE id = ANY($1::bigint[])
