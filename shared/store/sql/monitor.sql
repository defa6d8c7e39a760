-- The heartbeat-monitor's own statements (the shared lease statements are in leases.sql).

-- name: restart_deadlines_at_boot
-- No Running attempt is judged before a heartbeat timeout (+ $1, the lease margin) has passed
-- since Postgres started: executors could not renew while it was down. Anchored to Postgres's
-- start, not to the caller's, so any monitor may run it at any time: only a Postgres restart
-- moves a deadline, and by one timeout from that restart at most. Rows already past the
-- anchor are not written.
UPDATE tasks SET hb_deadline = pg_postmaster_start_time()
                               + make_interval(secs => heartbeat_timeout_s + $1)
WHERE status = 'running'
  AND hb_deadline < pg_postmaster_start_time() + make_interval(secs => heartbeat_timeout_s + $1)
  AND now() < pg_postmaster_start_time() + make_interval(secs => heartbeat_timeout_s + $1)

-- name: restart_deadlines_after_outage
-- A monitor that lost Postgres (from $1, Postgres's epoch when it last reached it, to now)
-- may have slept through an outage of everyone's: the attempts whose lease lapsed within it
-- get a heartbeat timeout (+ $2, the lease margin) from now to renew. Only those: a lease
-- lapsed before is not an outage's doing, and a lease is never moved here, so an attempt
-- nobody renews is given this once, however often a monitor fails after.
UPDATE tasks SET hb_deadline = greatest(hb_deadline,
                                        now() + make_interval(secs => heartbeat_timeout_s + $2))
WHERE status = 'running' AND lease_until >= to_timestamp($1) AND lease_until < now()

-- name: sweep_clock
-- Seconds until the earliest deadline (Postgres's clock), when this Postgres started (a
-- restart since the monitor last looked is an outage it slept through), and Postgres's now
-- (epoch seconds): where an outage the monitor sees next would begin.
SELECT (SELECT extract(epoch FROM min(hb_deadline) - now())::float8
        FROM tasks WHERE status = 'running') AS wait_s,
       extract(epoch FROM pg_postmaster_start_time())::float8 AS started,
       extract(epoch FROM now())::float8 AS now
