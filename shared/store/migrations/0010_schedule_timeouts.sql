-- Schedule-to-start timeouts (TaskSpec.schedule_timeout_s): the longest a task may wait in
-- Ready or Scheduling for its attempt to start, and when that runs out (Postgres time). The
-- deadline is set when the task enters Ready from a waiting state (Pending, RetryWait) and kept
-- while an attempt comes back to Ready without having run; the scheduler fails the task once
-- it has passed. The partial index holds only tasks that wait with a deadline, so the sweep
-- and its "when is the next one due" are index scans of the few rows that matter.
ALTER TABLE tasks ADD COLUMN schedule_timeout_s double precision CHECK (schedule_timeout_s > 0);
ALTER TABLE tasks ADD COLUMN schedule_deadline timestamptz;
CREATE INDEX tasks_schedule_deadline ON tasks (schedule_deadline)
    WHERE status IN ('ready', 'scheduling') AND schedule_deadline IS NOT NULL;
