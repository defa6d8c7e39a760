-- Executors register as nodes; a task's log tail is kept with it; placement counts the
-- attempts each node holds (Scheduling or Running) through a partial index.

ALTER TABLE tasks ADD COLUMN log_tail text;
-- resources asked for, as columns so that per-node usage is a plain aggregate
ALTER TABLE tasks ADD COLUMN cpu double precision NOT NULL DEFAULT 0 CHECK (cpu >= 0);
ALTER TABLE tasks ADD COLUMN memory_mb bigint NOT NULL DEFAULT 0 CHECK (memory_mb >= 0);
ALTER TABLE tasks ADD COLUMN gpu integer NOT NULL DEFAULT 0 CHECK (gpu >= 0);

CREATE INDEX tasks_active_by_node ON tasks (node) WHERE status IN ('scheduling', 'running');

CREATE TABLE nodes (
    id            text PRIMARY KEY CHECK (id ~ '^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$'),
    slots         integer NOT NULL CHECK (slots >= 1),
    cpu           double precision NOT NULL CHECK (cpu >= 0),
    memory_mb     bigint NOT NULL CHECK (memory_mb >= 0),
    gpu           integer NOT NULL CHECK (gpu >= 0),
    labels        jsonb NOT NULL DEFAULT '{}',
    ready         boolean NOT NULL DEFAULT true,
    load          double precision NOT NULL DEFAULT 0,
    boot_id       uuid NOT NULL,
    registered_at timestamptz NOT NULL DEFAULT now(),
    heartbeat_at  timestamptz NOT NULL DEFAULT now()
);
