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

-- name: vacuum_outbox
-- Make room of the rows relays deleted (shared.relay.OutboxRelay.vacuum_when_due). Until a
-- vacuum, their primary key entries stay at the head of the key, and `unpublished` walks
-- every one of them on every pass: ~2 ms a pass after 300,000 deleted rows, however few are
-- left, and on a server whose autovacuum is off (or slow to come round) without bound.
-- Another relay's vacuum under way is skipped, not waited for. Outside a transaction only. A
-- role that does not own the table would vacuum nothing (Postgres only logs a warning of its
-- own): relays ask `may_vacuum_outbox` first.
VACUUM (SKIP_LOCKED) outbox

-- name: may_vacuum_outbox
-- Whether this session's role may vacuum the outbox: it owns the table, or is a member of
-- the role that does (a superuser is a member of every role).
SELECT pg_has_role(c.relowner, 'MEMBER') FROM pg_class c WHERE c.oid = 'outbox'::regclass
