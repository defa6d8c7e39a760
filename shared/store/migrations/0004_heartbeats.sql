-- Heartbeats: a Running attempt's deadline and the highest heartbeat sequence applied.
-- The partial index on hb_deadline is the heartbeat-monitor's deadline index: finding the
-- overdue attempts is a range scan over Running tasks only, never a scan of them all.

ALTER TABLE tasks ADD COLUMN hb_deadline timestamptz;
ALTER TABLE tasks ADD COLUMN hb_at timestamptz;
ALTER TABLE tasks ADD COLUMN hb_seq bigint NOT NULL DEFAULT 0;

CREATE INDEX tasks_hb_deadline ON tasks (hb_deadline) WHERE status = 'running';
-- recovery's sweeps: attempts dispatched but never started, and tasks declared Lost
CREATE INDEX tasks_scheduling_since ON tasks (updated_at) WHERE status = 'scheduling';
CREATE INDEX tasks_lost_since ON tasks (updated_at) WHERE status = 'lost';

-- A result that arrived for an attempt that no longer owns its task (canceled, paused, lost
-- and retried): kept for the record, never applied.
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
CREATE INDEX late_results_task ON late_results (task_id);
