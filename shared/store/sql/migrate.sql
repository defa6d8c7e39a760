-- The migration ledger.

-- name: create_ledger
-- The table that records which migrations were applied.
CREATE TABLE IF NOT EXISTS schema_migrations (
    version    integer PRIMARY KEY,
    name       text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)

-- name: applied_migrations
-- The versions applied so far.
SELECT version FROM schema_migrations

-- name: record_migration
-- Record one applied migration.
INSERT INTO schema_migrations (version, name) VALUES ($1, $2)

-- name: autovacuum_on
-- Whether autovacuum runs on this server (`sked migrate` warns when it does not).
SELECT current_setting('autovacuum')::boolean

-- name: lock_migrations
-- Serialise `sked migrate` runs (a session lock; any constant nothing else uses).
SELECT pg_advisory_lock(1559035905)

-- name: unlock_migrations
-- Let the next `sked migrate` run.
SELECT pg_advisory_unlock(1559035905)
