-- The named workflow resources a task holds while it is Scheduling or Running (like a node's
-- usage, derived from the tasks themselves: released by the very CAS that ends the attempt).
ALTER TABLE tasks ADD COLUMN uses text[] NOT NULL DEFAULT '{}';
CREATE INDEX tasks_active_uses ON tasks (workflow_id)
    WHERE status IN ('scheduling', 'running') AND uses <> '{}';
