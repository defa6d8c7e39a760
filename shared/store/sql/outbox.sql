-- The outbox: one row per event not yet published (migration 0016), drained by relays shard by
-- shard and deleted once the broker confirmed it.

-- name: lock_free_shards
-- The shards no other relay is draining now (one relay per shard keeps each task's events in
-- version order).
SELECT shard FROM outbox_shards ORDER BY shard FOR UPDATE SKIP LOCKED

-- name: unpublished
-- The oldest outbox rows of these shards, each with its event as JSON (rendered when it was
-- written): the relay only concatenates. In id order along the primary key: a relay holding
-- every shard (the usual case) reads just the page it sends, however long the outbox.
SELECT id, task_id, to_status, body
FROM outbox
WHERE shard = ANY($1::smallint[])
ORDER BY id
LIMIT $2

-- name: mark_published
-- These events went out (confirmed by the broker): their outbox rows go.
DELETE FROM outbox WHERE id = ANY($1::bigint[])
