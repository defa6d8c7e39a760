-- Retention (SKED_RETENTION_DAYS, services/recovery): finished tasks are deleted once they
-- ended longer ago than the retention, a task outside any workflow alone and a workflow whole.
-- Each kind is found from an index in the order it ages, so a pass reads what it deletes and
-- not the history it keeps.

-- 1. Tasks outside any workflow that ended (or may have: Failed and TimedOut are terminal once
--    their retries are spent, which the statement checks), by when. Only ended rows are in it:
--    one entry a task, written by its last move.
CREATE INDEX tasks_ended_alone ON tasks (finished_at)
    WHERE workflow_id IS NULL
      AND status IN ('success', 'canceled', 'skipped', 'failed', 'timed_out');

-- 2. Workflows by age: one whose every task ended before the cutoff was created before it.
CREATE INDEX workflows_created ON workflows (created_at);
