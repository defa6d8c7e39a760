-- The migration ledger.

-- name: create_ledger
-- The table that records which migrations were applied.
CREATE TABLE IF NOT EXISTS schema_migrations (
    version    integer PRIMARY KEY,
    name       text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)

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

-- name: add_ledger_checksum
-- The sha256 of each file's text as applied (NULL: applied before sked recorded it).
ALTER TABLE schema_migrations ADD COLUMN IF NOT EXISTS sha256 text

-- name: record_checksum
-- Record the sha256 of the text a migration was applied from (in its transaction).
UPDATE schema_migrations SET sha256 = $2 WHERE version = $1

-- name: applied_checksums
-- The versions applied so far, each with the sha256 of its text (NULL: not recorded).
SELECT version, sha256 FROM schema_migrations

-- name: schema_version
-- The newest version applied (0: none).
SELECT coalesce(max(version), 0) FROM schema_migrations

-- name: ledger_schemas
-- The schema this session creates in (first of its search_path), and every schema that
-- holds a ledger: sked's tables are where the ledger is.
SELECT current_schema() AS here,
       array(SELECT n.nspname::text FROM pg_class c
             JOIN pg_namespace n ON n.oid = c.relnamespace
             WHERE c.relname = 'schema_migrations' AND c.relkind IN ('r', 'p')
             ORDER BY 1) AS found

-- name: set_lock_timeout
-- How long one statement of a migration may wait for a lock (this transaction only): every
-- write queued behind that wait waits as long.
SELECT set_config('lock_timeout', $1, true)

-- name: set_idle_timeout
-- How long this session may sit idle inside a transaction (a frozen migrator) before
-- Postgres ends it and releases what it locked.
SELECT set_config('idle_in_transaction_session_timeout', $1, false)

-- name: blocking_sessions
-- The sessions that hold a lock the given backend waits for.
SELECT pid, application_name, state, usename,
       round(extract(epoch FROM now() - xact_start))::int AS open_s
FROM pg_stat_activity
WHERE pid = ANY(pg_blocking_pids($1))
