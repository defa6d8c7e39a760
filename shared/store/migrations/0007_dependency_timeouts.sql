-- Per-edge dependency timeouts: the longest a task waits for an upstream, what then
-- ('skip': go on without it; 'default': go on with `default_value` as its input; 'fail'),
-- and when it happened (each timeout is recorded here and named in the task's next event).
ALTER TABLE task_deps ADD COLUMN timeout_s double precision CHECK (timeout_s > 0);
ALTER TABLE task_deps ADD COLUMN on_timeout text NOT NULL DEFAULT 'fail'
    CHECK (on_timeout IN ('skip', 'default', 'fail'));
ALTER TABLE task_deps ADD COLUMN default_value jsonb;
ALTER TABLE task_deps ADD COLUMN timed_out_at timestamptz;
