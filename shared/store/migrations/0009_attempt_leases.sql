-- Attempt leases: the attempt whose process may be alive (lease_attempt, run by the executor
-- incarnation lease_owner) and until when (lease_until, Postgres time). Set when an attempt
-- starts, renewed by its executor, released when the attempt is known ended. A task moves to
-- Lost, and a task's next attempt starts, only after lease_until + the safety margin: by then
-- the node's watchdog has frozen the old attempt's processes (docs/architecture.md).
ALTER TABLE tasks ADD COLUMN lease_owner uuid;
ALTER TABLE tasks ADD COLUMN lease_attempt integer;
ALTER TABLE tasks ADD COLUMN lease_until timestamptz;
