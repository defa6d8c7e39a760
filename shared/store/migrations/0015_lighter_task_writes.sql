-- Lighter writes on the hot path: every task's row is written four times in its life (created
-- into Ready, then Scheduling, Running, an end) and each write of a status adds an entry to
-- every index the new row version belongs to, and each event row is checked (docs/performance.md).

-- 1. An idempotency key is optional and most tasks have none, yet as a unique constraint it
--    indexed every row version, NULL keys included: four entries a task for nothing. Only
--    rows with a key are indexed now; uniqueness among them is as before, and an insert's
--    ON CONFLICT DO NOTHING still takes this index as an arbiter.
ALTER TABLE tasks DROP CONSTRAINT tasks_idempotency_key_key;
CREATE UNIQUE INDEX tasks_idempotency_key ON tasks (idempotency_key)
    WHERE idempotency_key IS NOT NULL;

-- 2. task_events.task_id's foreign key checked each event row against its task (a row lock
--    FOR KEY SHARE; ~14 us a row, six rows a task), though every event row is written by the
--    statement that creates or moves its task's row, from that row: the reference holds by
--    construction. Nothing deletes tasks; a retention job that will must delete their events
--    with them (ON DELETE CASCADE did).
ALTER TABLE task_events DROP CONSTRAINT task_events_task_id_fkey;
