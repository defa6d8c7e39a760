-- Tasks, their transition history, and the outbox that history doubles as.
-- Every status change is one CAS on tasks plus one task_events row, in one transaction.

CREATE TABLE tasks (
    id                  uuid PRIMARY KEY,
    name                text NOT NULL,
    kind                text NOT NULL CHECK (kind IN ('command', 'handler')),
    spec                jsonb NOT NULL,
    status              text NOT NULL CHECK (status IN (
                            'created', 'pending', 'ready', 'scheduling', 'running', 'success',
                            'failed', 'retry_wait', 'lost', 'timed_out', 'paused', 'canceled',
                            'skipped')),
    status_reason       text NOT NULL DEFAULT '',
    version             integer NOT NULL DEFAULT 1 CHECK (version >= 1),
    attempt             integer NOT NULL DEFAULT 0 CHECK (attempt >= 0),
    priority            integer NOT NULL DEFAULT 0,
    retry_count         integer NOT NULL DEFAULT 0 CHECK (retry_count >= 0),
    max_retries         integer NOT NULL DEFAULT 0 CHECK (max_retries >= 0),
    next_retry_at       timestamptz,
    timeout_s           double precision CHECK (timeout_s > 0),
    heartbeat_timeout_s double precision NOT NULL CHECK (heartbeat_timeout_s > 0),
    node                text,
    idempotency_key     text UNIQUE,
    paused_by           text,
    paused_reason       text,
    paused_at           timestamptz,
    result              jsonb,
    error               text,
    created_at          timestamptz NOT NULL DEFAULT now(),
    updated_at          timestamptz NOT NULL DEFAULT now(),
    queued_at           timestamptz,
    started_at          timestamptz,
    finished_at         timestamptz
);

-- pick_runnable: Ready tasks, highest priority first, oldest first within a priority.
CREATE INDEX tasks_runnable ON tasks (priority DESC, queued_at, id) WHERE status = 'ready';
-- the retry sweep: RetryWait tasks whose backoff has elapsed.
CREATE INDEX tasks_retry_due ON tasks (next_retry_at) WHERE status = 'retry_wait';
-- listing by status (sked list --status S), newest first.
CREATE INDEX tasks_status_created ON tasks (status, created_at DESC);

CREATE TABLE task_events (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    task_id      uuid NOT NULL REFERENCES tasks (id) ON DELETE CASCADE,
    from_status  text,
    to_status    text NOT NULL,
    version      integer NOT NULL,
    attempt      integer NOT NULL,
    reason       text NOT NULL DEFAULT '',
    at           timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- outbox: relays publish events in shards so each task's events leave in version order.
    shard        smallint NOT NULL GENERATED ALWAYS AS (get_byte(uuid_send(task_id), 15) % 16) STORED,
    published_at timestamptz,
    UNIQUE (task_id, version)
);

-- the relay's work list stays small: only unpublished rows are indexed.
CREATE INDEX task_events_unpublished ON task_events (shard, id) WHERE published_at IS NULL;

-- One row per outbox shard. A relay locks the shards it drains (FOR UPDATE SKIP LOCKED), so
-- relays share the work, and one task's events (always in one shard) are never sent by two
-- relays at once: per-task order survives any number of relays.
CREATE TABLE outbox_shards (
    shard smallint PRIMARY KEY
);
INSERT INTO outbox_shards (shard) SELECT generate_series(0, 15);
