-- Pieces of SQL that several statements share, each defined once. A statement uses one as
-- {{name}} or, with an argument, {{name(argument)}}; `shared.store.queries` expands them.

-- fragment: task_columns(p)
-- Every column a Task is read from (models.Task), each prefixed with `p` (a table alias and
-- a dot, or nothing).
{{p}}id, {{p}}name, {{p}}kind, {{p}}spec::text AS spec_json, {{p}}status, {{p}}status_reason,
{{p}}version, {{p}}attempt, {{p}}priority, {{p}}retry_count, {{p}}max_retries,
{{p}}next_retry_at, {{p}}timeout_s, {{p}}heartbeat_timeout_s, {{p}}node, {{p}}idempotency_key,
{{p}}paused_by, {{p}}paused_reason, {{p}}paused_at, {{p}}result, {{p}}error, {{p}}created_at,
{{p}}updated_at, {{p}}queued_at, {{p}}started_at, {{p}}finished_at, {{p}}log_tail, {{p}}cpu,
{{p}}memory_mb, {{p}}gpu, {{p}}traceparent, {{p}}hb_at, {{p}}hb_deadline, {{p}}hb_seq,
{{p}}workflow_id, {{p}}wf_task, {{p}}uses, {{p}}inputs, {{p}}lease_owner, {{p}}lease_attempt,
{{p}}lease_until, {{p}}schedule_timeout_s, {{p}}schedule_deadline, {{p}}launch_failures,
{{p}}max_launch_failures

-- fragment: task_columns_at(level)
-- The columns of task_columns, read back at a level (`level`, per row; shared.store.tasks
-- names them): 0, the id, the status, the version, the attempt and the node (what a move
-- decides about an attempt) and NULL for the rest; 1, those and what a hook reads of a moved
-- task (shared.hooks.SEEN: its name, trace parent and times); 2, the whole row. The rows a
-- caller asked only whether they moved, or where (fsm.Move.read_back), cost Postgres little
-- output and the client little decoding, with metrics or tracing on too. (tests/unit/
-- test_queries.py checks that it names task_columns's columns, in their order, and that
-- level 1 is hooks.SEEN.)
id,
CASE WHEN {{level}} >= 1 THEN name END AS name,
CASE WHEN {{level}} >= 2 THEN kind END AS kind,
CASE WHEN {{level}} >= 2 THEN spec::text END AS spec_json,
status,
CASE WHEN {{level}} >= 2 THEN status_reason END AS status_reason,
version,
attempt,
CASE WHEN {{level}} >= 2 THEN priority END AS priority,
CASE WHEN {{level}} >= 2 THEN retry_count END AS retry_count,
CASE WHEN {{level}} >= 2 THEN max_retries END AS max_retries,
CASE WHEN {{level}} >= 2 THEN next_retry_at END AS next_retry_at,
CASE WHEN {{level}} >= 2 THEN timeout_s END AS timeout_s,
CASE WHEN {{level}} >= 2 THEN heartbeat_timeout_s END AS heartbeat_timeout_s,
node,
CASE WHEN {{level}} >= 2 THEN idempotency_key END AS idempotency_key,
CASE WHEN {{level}} >= 2 THEN paused_by END AS paused_by,
CASE WHEN {{level}} >= 2 THEN paused_reason END AS paused_reason,
CASE WHEN {{level}} >= 2 THEN paused_at END AS paused_at,
CASE WHEN {{level}} >= 2 THEN result END AS result,
CASE WHEN {{level}} >= 2 THEN error END AS error,
CASE WHEN {{level}} >= 1 THEN created_at END AS created_at,
CASE WHEN {{level}} >= 2 THEN updated_at END AS updated_at,
CASE WHEN {{level}} >= 1 THEN queued_at END AS queued_at,
CASE WHEN {{level}} >= 1 THEN started_at END AS started_at,
CASE WHEN {{level}} >= 1 THEN finished_at END AS finished_at,
CASE WHEN {{level}} >= 2 THEN log_tail END AS log_tail,
CASE WHEN {{level}} >= 2 THEN cpu END AS cpu,
CASE WHEN {{level}} >= 2 THEN memory_mb END AS memory_mb,
CASE WHEN {{level}} >= 2 THEN gpu END AS gpu,
CASE WHEN {{level}} >= 1 THEN traceparent END AS traceparent,
CASE WHEN {{level}} >= 2 THEN hb_at END AS hb_at,
CASE WHEN {{level}} >= 2 THEN hb_deadline END AS hb_deadline,
CASE WHEN {{level}} >= 2 THEN hb_seq END AS hb_seq,
CASE WHEN {{level}} >= 2 THEN workflow_id END AS workflow_id,
CASE WHEN {{level}} >= 2 THEN wf_task END AS wf_task,
CASE WHEN {{level}} >= 2 THEN uses END AS uses,
CASE WHEN {{level}} >= 2 THEN inputs END AS inputs,
CASE WHEN {{level}} >= 2 THEN lease_owner END AS lease_owner,
CASE WHEN {{level}} >= 2 THEN lease_attempt END AS lease_attempt,
CASE WHEN {{level}} >= 2 THEN lease_until END AS lease_until,
CASE WHEN {{level}} >= 2 THEN schedule_timeout_s END AS schedule_timeout_s,
CASE WHEN {{level}} >= 2 THEN schedule_deadline END AS schedule_deadline,
CASE WHEN {{level}} >= 2 THEN launch_failures END AS launch_failures,
CASE WHEN {{level}} >= 2 THEN max_launch_failures END AS max_launch_failures

-- fragment: event_columns
-- Every column an Event is read from (models.Event).
id, task_id, from_status, to_status, version, attempt, reason, at

-- fragment: to_outbox(events)
-- The outbox rows announcing the event rows CTE `events` inserted (its RETURNING
-- {{event_columns}}), each carrying its event as the JSON of models.Event, rendered here once.
-- A statement's rows go in version order: a relay sends in id order, so a task's events
-- (several in one statement when a submission walks Created -> Ready) leave in version order.
INSERT INTO outbox (task_id, to_status, at, body)
SELECT task_id, to_status, at,
       json_build_object('id', id, 'task_id', task_id, 'from_status', from_status,
                         'to_status', to_status, 'version', version, 'attempt', attempt,
                         'reason', reason, 'at', at)::text
FROM {{events}}
ORDER BY version

-- fragment: locked_in_id_order(where)
-- The body of a CTE that locks the tasks a statement's CTE `u` names, in id order, and yields
-- their rows of `u`: the statement then reads `FROM locked u`. An UPDATE locks rows in whatever
-- order its join visits them, so two batches over overlapping rows could each hold one the
-- other waits for; locked in one order, they queue instead. After a wait FOR UPDATE re-checks
-- `where` on the newest row, so a row that no longer qualifies is not written. (Carrying u's
-- columns, rather than joining `u` to the locked ids again, keeps the CAS function's generic
-- plan, which may not hash-join, from a nested loop over both lists: quadratic in the batch.)
SELECT u.* FROM tasks t JOIN u ON u.id = t.id WHERE {{where}} ORDER BY t.id FOR UPDATE OF t

-- fragment: skip_locked_in_id_order(where)
-- The same for writes that may be dropped: rows another statement holds are passed over.
SELECT u.* FROM tasks t JOIN u ON u.id = t.id WHERE {{where}}
ORDER BY t.id FOR UPDATE OF t SKIP LOCKED

-- fragment: notify(moved)
-- The one NOTIFY of a statement that moved the rows of CTE `moved`, on channel sked_task
-- (repo.TASK_CHANNEL), with the payload `task_payload`. One per transaction: every notifying
-- commit serialises on Postgres's notification queue. A statement that moved tasks into
-- Running only (an executor's claims) tells it on sked_started (repo.STARTED_CHANNEL)
-- instead: a start frees, ends and decides nothing, so the scheduler and waiting clients,
-- which listen on sked_task, are not woken by one; the relay listens on both.
SELECT pg_notify(
    CASE WHEN bool_and(status = 'running') THEN 'sked_started' ELSE 'sked_task' END,
    {{task_payload}})
FROM {{moved}}
HAVING count(*) > 0

-- fragment: notify_taken(moved)
-- The NOTIFY, on channel sked_taken (repo.TAKEN_CHANNEL), of the rows of `moved` that went
-- into a state that takes a running attempt away from its node (fsm.TAKES_AWAY), with the
-- payload `task_payload`; none when there are none, as for most statements. The executors
-- listen here rather than on sked_task, so the notifications of the moves they ignore (most)
-- do not wake their processes; recovery too (it acts on Lost).
SELECT pg_notify('sked_taken', {{task_payload}})
FROM {{moved}}
WHERE status IN ({{taken_away_states}})
HAVING count(*) > 0

-- fragment: task_payload
-- A notification's payload over the rows aggregated: "<id>:<version>:[d:][w:]<state>" per
-- task, space-separated, up to 100 tasks; beyond that "*:<count>:<state,state...>". `d:`
-- marks a task with a schedule deadline (only those wake the scheduler's schedule-timeout
-- loop), `w:` a workflow's task (only those wake its workflow resolution); `w:` comes last,
-- where readers before `d:` look for it (shared/store/notify.parse_notify reads it).
CASE WHEN count(*) <= 100
     THEN string_agg(id::text || ':' || version || ':'
                     || CASE WHEN schedule_deadline IS NULL THEN '' ELSE 'd:' END
                     || CASE WHEN workflow_id IS NULL THEN '' ELSE 'w:' END
                     || status, ' ')
     ELSE '*:' || count(*) || ':' || string_agg(DISTINCT status, ',') END

-- fragment: placed_channel(node)
-- The channel on which a node is told of attempts just placed on it (notify.placed_channel):
-- its id hashed, since a channel name holds at most 63 bytes and a node id may be 63 itself.
'sked_placed_' || md5({{node}})

-- fragment: placed_payload
-- The attempts of one node a statement placed, over the rows aggregated, as that node's
-- dispatches (models.Dispatch; shared.dispatches.placed reads them):
-- "<id>:<version>:<attempt>:<retry_count>:<max_retries>" each, space-separated, 100 at most.
string_agg(id::text || ':' || version || ':' || attempt || ':' || retry_count || ':'
           || max_retries, ' ')

-- fragment: taken_away_states
-- The states a move into takes a running attempt away from its node (fsm.TAKES_AWAY).
'paused', 'canceled', 'lost', 'retry_wait'

-- fragment: slot_states
-- The states in which an attempt holds its node's slot and resources (fsm.HOLDS_SLOT).
'scheduling', 'running'

-- fragment: holds_slot
-- The task's attempt holds its node's slot and resources, and its workflow's named resources:
-- placed or running; or paused or canceled (or resumed since) while its executor could not
-- hear it, running on until its lease ends or is released (index tasks_lease_held). Else a
-- task placed beside it could overcommit the node, or a second holder take a resource of 1.
(t.status IN ({{slot_states}}) OR {{held_past_stop}})

-- fragment: held_past_stop
-- holds_slot's second part alone: paused or canceled unheard, its lease not over yet.
(t.lease_until IS NOT NULL AND t.status NOT IN ({{slot_states}}) AND t.lease_until > now())

-- fragment: awaits_start_states
-- The states in which a task waits for its attempt to start (fsm.AWAITS_START); the partial
-- index tasks_schedule_deadline is written over the same list.
'ready', 'scheduling'

-- fragment: has_ended(p)
-- The task (its columns prefixed with `p`: a table alias and a dot, or nothing) has ended for
-- good: fsm.is_terminal in SQL, ended outright or failed with no retry left.
({{p}}status IN ({{terminal_states}})
 OR ({{p}}status IN ({{retryable_states}}) AND {{p}}retry_count >= {{p}}max_retries))

-- fragment: terminal_states
-- The states that end a task outright (fsm.ALWAYS_TERMINAL).
'success', 'canceled', 'skipped'

-- fragment: retryable_states
-- The states that end a task once its retries are spent (fsm.RETRYABLE).
'failed', 'timed_out'

-- fragment: ends_lease
-- A move out of Running that proves the attempt's process ended; Paused and Canceled do not.
u.from_status = 'running' AND u.to_status NOT IN ('paused', 'canceled')

-- fragment: lease_over(margin)
-- The lease has run out by the safety margin: the attempt's processes are frozen or dead.
(t.lease_until IS NULL OR t.lease_until + make_interval(secs => {{margin}}) < now())
