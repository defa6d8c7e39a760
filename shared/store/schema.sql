-- The schema as it stands after every migration: what shared/store/migrations builds, step by
-- step, written out whole for a reader (tests/integration/test_migrate.py checks that the two
-- yield the same catalogue). Change the schema with a new migration, then here.
-- Not here: the functions statements call (sked_transition, the CAS; sked_nodes, the nodes
-- with their usage), which `sked migrate` defines anew from their text in sql/*.sql after
-- the migration files.

-- Workflows: a DAG of tasks submitted together, and one row per edge.
CREATE TABLE workflows (
    id         uuid PRIMARY KEY,
    name       text NOT NULL,
    spec       jsonb NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX workflows_created ON workflows (created_at);  -- retention (0017)

-- One row per task: its spec, where it is in its lifecycle, and its current attempt.
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
    version             integer NOT NULL DEFAULT 1 CHECK (version >= 1),  -- the CAS token
    attempt             integer NOT NULL DEFAULT 0 CHECK (attempt >= 0),
    priority            integer NOT NULL DEFAULT 0,  -- effective (inherited) priority
    retry_count         integer NOT NULL DEFAULT 0 CHECK (retry_count >= 0),
    max_retries         integer NOT NULL DEFAULT 0 CHECK (max_retries >= 0),
    next_retry_at       timestamptz,
    timeout_s           double precision CHECK (timeout_s > 0),
    heartbeat_timeout_s double precision NOT NULL CHECK (heartbeat_timeout_s > 0),
    node                text,
    idempotency_key     text,  -- unique among the tasks that have one (index below)
    paused_by           text,
    paused_reason       text,
    paused_at           timestamptz,
    result              jsonb,
    error               text,
    created_at          timestamptz NOT NULL DEFAULT now(),
    updated_at          timestamptz NOT NULL DEFAULT now(),
    queued_at           timestamptz,
    started_at          timestamptz,
    finished_at         timestamptz,
    log_tail            text,
    -- resources asked for, as columns, so that a node's usage is a plain aggregate
    cpu                 double precision NOT NULL DEFAULT 0 CHECK (cpu >= 0),
    memory_mb           bigint NOT NULL DEFAULT 0 CHECK (memory_mb >= 0),
    gpu                 integer NOT NULL DEFAULT 0 CHECK (gpu >= 0),
    traceparent         text,  -- the producer's W3C trace context
    -- heartbeats: the monitor's next look, the last beat, the highest sequence applied
    hb_deadline         timestamptz,
    hb_at               timestamptz,
    hb_seq              bigint NOT NULL DEFAULT 0,
    -- workflows
    workflow_id         uuid REFERENCES workflows (id) ON DELETE CASCADE,
    wf_task             text,
    uses                text[] NOT NULL DEFAULT '{}',
    inputs              jsonb,
    -- the attempt lease: which attempt's process may be alive, whose, until when
    lease_owner         uuid,
    lease_attempt       integer,
    lease_until         timestamptz,
    -- the schedule-to-start timeout, and when it runs out (kept while an attempt comes back to
    -- Ready without having run; set anew when the task enters Ready from Pending or RetryWait)
    schedule_timeout_s  double precision CHECK (schedule_timeout_s > 0),
    schedule_deadline   timestamptz,
    -- attempts that never started (a backend's launch failure), and how many may
    launch_failures     integer NOT NULL DEFAULT 0 CHECK (launch_failures >= 0),
    max_launch_failures integer NOT NULL DEFAULT 3 CHECK (max_launch_failures >= 0)
);

CREATE UNIQUE INDEX tasks_idempotency_key ON tasks (idempotency_key)
    WHERE idempotency_key IS NOT NULL;
CREATE INDEX tasks_runnable ON tasks (priority DESC, queued_at, id) WHERE status = 'ready';
CREATE INDEX tasks_retry_due ON tasks (next_retry_at) WHERE status = 'retry_wait';
CREATE INDEX tasks_status_created ON tasks (status, created_at DESC);
CREATE INDEX tasks_active_by_node ON tasks (node) WHERE status IN ('scheduling', 'running');
-- attempts paused or canceled unheard, running on until their leases end (0019)
CREATE INDEX tasks_lease_held ON tasks (node, lease_until)
    WHERE lease_until IS NOT NULL AND status NOT IN ('scheduling', 'running');
CREATE INDEX tasks_hb_deadline ON tasks (hb_deadline) WHERE status = 'running';
CREATE INDEX tasks_scheduling_since ON tasks (updated_at) WHERE status = 'scheduling';
CREATE INDEX tasks_lost_since ON tasks (updated_at) WHERE status = 'lost';
CREATE INDEX tasks_workflow ON tasks (workflow_id) WHERE workflow_id IS NOT NULL;
CREATE INDEX tasks_active_uses ON tasks (workflow_id)
    WHERE status IN ('scheduling', 'running') AND uses <> '{}';
CREATE INDEX tasks_schedule_deadline ON tasks (schedule_deadline)
    WHERE status IN ('ready', 'scheduling') AND schedule_deadline IS NOT NULL;
-- retention (0017): the ended tasks outside any workflow, by when they ended
CREATE INDEX tasks_ended_alone ON tasks (finished_at)
    WHERE workflow_id IS NULL
      AND status IN ('success', 'canceled', 'skipped', 'failed', 'timed_out');

-- The transition history: one row per state change, written with it, never changed.
CREATE TABLE task_events (
    id           bigint GENERATED ALWAYS AS IDENTITY,  -- in every relayed event; not indexed
    -- no foreign key: each row is written with its task's row, by one statement (0015)
    task_id      uuid NOT NULL,
    from_status  text,
    to_status    text NOT NULL,
    version      integer NOT NULL,
    attempt      integer NOT NULL,
    reason       text NOT NULL DEFAULT '',
    at           timestamptz NOT NULL DEFAULT clock_timestamp(),
    UNIQUE (task_id, version)  -- its key: history reads, and no move recorded twice
);

-- The outbox: the events not yet published, each as its JSON; a relay deletes what the broker
-- confirmed (0016).
CREATE TABLE outbox (
    id        bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    task_id   uuid NOT NULL,
    shard     smallint NOT NULL GENERATED ALWAYS AS (get_byte(uuid_send(task_id), 15) % 16) STORED,
    to_status text NOT NULL,
    at        timestamptz NOT NULL,
    body      text NOT NULL
);

-- One row per outbox shard: a relay locks the shards it drains.
CREATE TABLE outbox_shards (
    shard smallint PRIMARY KEY
);

-- One row per executor (node).
CREATE TABLE nodes (
    id            text PRIMARY KEY CHECK (id ~ '^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$'),
    slots         integer NOT NULL CHECK (slots >= 1),
    -- dispatches it holds beyond its slots, started as slots free (SKED_PREFETCH)
    prefetch      integer NOT NULL DEFAULT 0 CHECK (prefetch >= 0),
    cpu           double precision NOT NULL CHECK (cpu >= 0),
    memory_mb     bigint NOT NULL CHECK (memory_mb >= 0),
    gpu           integer NOT NULL CHECK (gpu >= 0),
    labels        jsonb NOT NULL DEFAULT '{}',
    ready         boolean NOT NULL DEFAULT true,
    load          double precision NOT NULL DEFAULT 0,
    boot_id       uuid NOT NULL,
    registered_at timestamptz NOT NULL DEFAULT now(),
    heartbeat_at  timestamptz NOT NULL DEFAULT now(),
    -- a cordoned node takes no new work; re-registering and heartbeats keep the cordon
    cordoned_at   timestamptz,
    cordoned_by   text,
    cordon_reason text,
    -- its executor stopped cleanly (0020): not counted by the healthy-nodes trigger
    left_at       timestamptz
);

-- Outcomes of attempts that no longer owned their task: kept, never applied.
CREATE TABLE late_results (
    id        bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    task_id   uuid NOT NULL REFERENCES tasks (id) ON DELETE CASCADE,
    attempt   integer NOT NULL,
    ok        boolean NOT NULL,
    result    jsonb,
    error     text,
    note      text NOT NULL,
    at        timestamptz NOT NULL DEFAULT now()
);
CREATE UNIQUE INDEX late_results_attempt ON late_results (task_id, attempt);  -- once (0021)

-- The object each attempt of a cluster backend runs as (a Kubernetes Job), once it exists.
CREATE TABLE launches (
    task_id    uuid NOT NULL REFERENCES tasks (id) ON DELETE CASCADE,
    attempt    integer NOT NULL,
    name       text NOT NULL,
    uid        text NOT NULL,
    executor   text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (task_id, attempt)
);
CREATE INDEX launches_executor ON launches (executor);

-- The degrade mode every scheduler obeys (shared/degrade.py): one row, changed by CAS.
CREATE TABLE degrade (
    id        boolean PRIMARY KEY DEFAULT true CHECK (id),
    mode      text NOT NULL DEFAULT 'normal' CHECK (mode IN ('normal', 'partial', 'full')),
    automatic boolean NOT NULL DEFAULT false,
    reason    text NOT NULL DEFAULT '',
    set_by    text NOT NULL DEFAULT '',
    since     timestamptz NOT NULL DEFAULT now(),
    until     timestamptz,
    version   integer NOT NULL DEFAULT 1,
    -- since when an automatic mode's cause has been gone (0020; NULL: it holds, or none)
    calm_since timestamptz
);
INSERT INTO degrade DEFAULT VALUES;

CREATE TABLE task_deps (
    task_id       uuid NOT NULL REFERENCES tasks (id) ON DELETE CASCADE,
    upstream_id   uuid NOT NULL REFERENCES tasks (id) ON DELETE CASCADE,
    condition     text NOT NULL CHECK (condition IN ('on_success', 'on_failure', 'always')),
    timeout_s     double precision CHECK (timeout_s > 0),
    on_timeout    text NOT NULL DEFAULT 'fail' CHECK (on_timeout IN ('skip', 'default', 'fail')),
    default_value jsonb,
    timed_out_at  timestamptz,
    PRIMARY KEY (task_id, upstream_id)
);
CREATE INDEX task_deps_upstream ON task_deps (upstream_id);

-- Operator API tokens (services/api): only the SHA-256 of each secret; names never reused.
CREATE TABLE api_tokens (
    name          text PRIMARY KEY CHECK (name ~ '^[A-Za-z0-9][A-Za-z0-9_.@-]{0,62}$'),
    role          text NOT NULL CHECK (role IN ('read', 'operate', 'admin')),
    secret_sha256 text NOT NULL UNIQUE CHECK (secret_sha256 ~ '^[0-9a-f]{64}$'),
    created_at    timestamptz NOT NULL DEFAULT now(),
    revoked_at    timestamptz,
    last_used_at  timestamptz
);

-- Every change made through the API, by token.
CREATE TABLE api_audit (
    id     bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at     timestamptz NOT NULL DEFAULT now(),
    token  text NOT NULL,
    action text NOT NULL,
    target text NOT NULL,
    detail text NOT NULL DEFAULT ''
);
CREATE INDEX api_audit_at ON api_audit (at);

-- The ids of tasks and workflows retention deleted, and when (0018): a read or a wait for one
-- says so. Deleted one retention later. created_at (0022): the deleted row's, where a listing
-- paged by its id goes on from.
CREATE TABLE purged (
    id         uuid PRIMARY KEY,
    purged_at  timestamptz NOT NULL DEFAULT now(),
    created_at timestamptz
);
CREATE INDEX purged_at ON purged (purged_at);
