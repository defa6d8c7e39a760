-- Claims: rows locked with SKIP LOCKED inside a transaction, then moved through the FSM in
-- the same transaction, so that replicas share the work and never take the same row.

-- name: claim_runnable
-- Ready tasks, highest priority first, oldest first within a priority.
SELECT {{task_columns()}} FROM tasks
WHERE status = 'ready'
ORDER BY priority DESC, queued_at, id
LIMIT $1
FOR UPDATE SKIP LOCKED

-- name: claim_retry_due
-- RetryWait tasks whose backoff has run out, by Postgres's clock.
SELECT {{task_columns()}} FROM tasks
WHERE status = 'retry_wait' AND next_retry_at <= now()
ORDER BY next_retry_at
LIMIT $1
FOR UPDATE SKIP LOCKED

-- name: claim_lost
-- Lost tasks, for recovery to retry or fail.
SELECT {{task_columns()}} FROM tasks
WHERE status = 'lost'
ORDER BY updated_at
LIMIT $1
FOR UPDATE SKIP LOCKED

-- name: claim_stuck_scheduling
-- Attempts dispatched but not started within $2 seconds.
SELECT {{task_columns()}} FROM tasks
WHERE status = 'scheduling' AND updated_at < now() - make_interval(secs => $2)
ORDER BY updated_at
LIMIT $1
FOR UPDATE SKIP LOCKED

-- name: claim_schedule_timed_out
-- Tasks still waiting to start (Ready or Scheduling) whose schedule deadline has passed, by
-- Postgres's clock, earliest first. A claim CAS Scheduling -> Running racing this one either
-- holds the row (it is skipped here and runs) or waits, then loses to the Failed move.
SELECT {{task_columns()}} FROM tasks
WHERE status IN ({{awaits_start_states}}) AND schedule_deadline IS NOT NULL
  AND schedule_deadline <= now()
ORDER BY schedule_deadline
LIMIT $1
FOR UPDATE SKIP LOCKED
