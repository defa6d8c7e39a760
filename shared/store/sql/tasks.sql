-- Tasks: creation, the CAS that moves them, and reads.

-- name: insert_tasks
-- Create tasks and walk them through their first moves in one statement (the CTEs of
-- `admission`, which says how); returns the rows it created.
WITH {{admission}}
SELECT ins.*, (SELECT count(*) FROM note) AS _notified FROM ins

-- fragment: admission
-- The CTEs that create tasks and walk them through their first moves: each row is inserted
-- in the last state of the walk ($13-$15, planned and checked by fsm.walk), with one event per
-- step. A redelivered submission (same id) or a taken idempotency key creates nothing, and
-- nor does an id without a key that retention deleted (its tombstone, table purged): that id
-- is its submission's message id, so this is the same submission, already run (a key is
-- free again once its task is deleted: README). No CAS is needed, as nobody else can hold a
-- row this statement creates. A task walked into Ready gets its schedule deadline ($19:
-- schedule_timeout_s) as `transition` would give it, and a place in line after the ones
-- before it in the batch: its queued_at is now() plus its position in microseconds (with
-- one now() for all, the line broke their tie by task id). $20: max_launch_failures.
-- CTE `ins` holds the rows created; `note` must be read (NOTIFY).
w AS (
    SELECT * FROM unnest($13::text[], $14::text[], $15::text[]) WITH ORDINALITY
                  AS w(from_status, to_status, reason, version)
), last AS (
    SELECT to_status, reason, version FROM w ORDER BY version DESC LIMIT 1
), ins AS (
    INSERT INTO tasks (id, name, kind, spec, status, status_reason, version, priority,
                       max_retries, timeout_s, heartbeat_timeout_s, idempotency_key, cpu,
                       memory_mb, gpu, traceparent, queued_at, workflow_id, wf_task, uses,
                       schedule_timeout_s, schedule_deadline, max_launch_failures)
    SELECT u.id, u.name, u.kind, u.spec::jsonb, last.to_status, last.reason, last.version,
           u.priority, u.max_retries, u.timeout_s, u.hb, u.ikey, u.cpu, u.memory_mb, u.gpu,
           u.traceparent,
           CASE WHEN last.to_status = 'ready' THEN now() + (u.n - 1) * interval '1 microsecond' END,
           $17::uuid,
           CASE WHEN $17::uuid IS NULL THEN NULL ELSE u.name END,
           ARRAY(SELECT jsonb_array_elements_text(u.uses::jsonb)), u.sched,
           CASE WHEN last.to_status = 'ready' THEN now() + make_interval(secs => u.sched) END,
           u.max_launch
    FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::int[], $6::int[],
                $7::float8[], $8::float8[], $9::text[], $10::float8[], $11::bigint[],
                $12::int[], $16::text[], $18::text[], $19::float8[], $20::int[])
         WITH ORDINALITY
         AS u(id, name, kind, spec, priority, max_retries, timeout_s, hb, ikey, cpu, memory_mb,
              gpu, traceparent, uses, sched, max_launch, n)
    CROSS JOIN last
    WHERE u.ikey IS NOT NULL OR NOT EXISTS (SELECT 1 FROM purged p WHERE p.id = u.id)
    ON CONFLICT DO NOTHING
    RETURNING {{task_columns()}}
), ev AS (
    INSERT INTO task_events (task_id, from_status, to_status, version, attempt, reason)
    SELECT ins.id, w.from_status, w.to_status, w.version, 0, w.reason FROM ins CROSS JOIN w
    RETURNING {{event_columns}}
), outbox AS ({{to_outbox(ev)}}
), note AS ({{notify(ins)}})

-- name: admit_and_place
-- Admission and placement in one round trip, for submissions nothing waits ahead of
-- (function sked_admit, defined by define_admit below): $1-$20 as insert_tasks, $21-$26 the
-- placements planned (Ready -> Scheduling moves, as `transition`'s $1-$6), $27-$28 each
-- planned node with the boot id it was read with, $29 the live TTL, $30 the lease margin.
SELECT {{task_columns()}}
FROM sked_admit($1::uuid[], $2::text[], $3::text[], $4::text[], $5::int[], $6::int[],
                $7::float8[], $8::float8[], $9::text[], $10::float8[], $11::bigint[],
                $12::int[], $13::text[], $14::text[], $15::text[], $16::text[], $17::uuid,
                $18::text[], $19::float8[], $20::int[], $21::uuid[], $22::int[], $23::text[],
                $24::text[], $25::text[], $26::text[], $27::text[], $28::uuid[], $29::float8,
                $30::float8)

-- name: define_admit
-- Admit new tasks and place them where the caller planned, under the planned nodes' locks:
-- what `insert_tasks` does, then what a dispatch pass does between its node locks and its
-- commit, in one call and one transaction (autocommit). The caller placed the tasks on the
-- nodes as it read them moments before, without locks (`nodes_with_usage`); so here, each
-- planned node is locked (in id order, as every placement locks them) if it is still live,
-- ready, uncordoned and of the same incarnation (its boot id), and then its labels and usage
-- are read by a statement of its own (a snapshot taken after the lock, as in sked_nodes). A
-- node takes its planned tasks only if all of them still fit: its labels carry every planned
-- task's selector (a cluster node's boot id is the same at every registration, so a node
-- relabelled since the read keeps it), and its attempts held (Scheduling or Running) plus the
-- planned ones are within its slots and backlog, cpu, memory and gpu. The degrade mode must
-- be normal. Only tasks this call created
-- are moved (an existing one keeps its state); those not moved stay Ready for the caller to
-- queue. The moves go through sked_transition: the same CAS, events and NOTIFY as any move.
-- Returns the created tasks as they stand at the end. Why it pays: at 100 tasks/s the lone
-- submission's transaction was five round trips (BEGIN, insert, node locks and usage, CAS,
-- COMMIT), ~4-5 ms of its submit -> start (docs/performance.md, the fifteenth session).
CREATE OR REPLACE FUNCTION sked_admit(
    uuid[], text[], text[], text[], int[], int[], float8[], float8[], text[], float8[],
    bigint[], int[], text[], text[], text[], text[], uuid, text[], float8[], int[],
    m_ids uuid[], m_versions int[], m_from text[], m_to text[], m_reasons text[],
    m_patches text[], n_ids text[], n_boots uuid[], ttl_s float8, margin float8
) RETURNS SETOF tasks
LANGUAGE plpgsql
{{planned_once}}
SET jit = off
AS $fn$
#variable_conflict use_column
DECLARE
    fresh uuid[];
    held text[];
    fit text[];
BEGIN
    WITH {{admission}}
    SELECT COALESCE(array_agg(ins.id), '{}') INTO fresh FROM ins
    WHERE (SELECT count(*) FROM note) >= 0;
    IF cardinality(m_ids) > 0 AND cardinality(fresh) > 0 AND EXISTS (
        SELECT 1 FROM degrade d
        WHERE d.mode = 'normal' OR d.until - now() <= interval '0'
    ) THEN
        SELECT COALESCE(array_agg(l.id), '{}') INTO held FROM (
            SELECT n.id FROM nodes n
            JOIN unnest(n_ids, n_boots) AS b(id, boot_id) ON b.id = n.id
            WHERE n.boot_id = b.boot_id AND n.ready AND n.cordoned_at IS NULL
                  AND n.heartbeat_at > now() - make_interval(secs => ttl_s)
            ORDER BY n.id
            FOR UPDATE OF n
        ) l;
        SELECT COALESCE(array_agg(want.node), '{}') INTO fit
        FROM (
            SELECT m.patch::jsonb ->> 'node' AS node, count(*) AS n, sum(t.cpu) AS cpu,
                   sum(t.memory_mb) AS memory_mb, sum(t.gpu) AS gpu,
                   array_agg(DISTINCT COALESCE(t.spec -> 'selector', '{}')) AS selectors
            FROM unnest(m_ids, m_patches) AS m(id, patch)
            JOIN tasks t ON t.id = m.id
            WHERE m.id = ANY(fresh)
            GROUP BY 1
        ) want
        JOIN nodes n ON n.id = want.node
        LEFT JOIN LATERAL (
            SELECT count(*) AS n, COALESCE(sum(t.cpu), 0) AS cpu,
                   COALESCE(sum(t.memory_mb), 0) AS memory_mb, COALESCE(sum(t.gpu), 0) AS gpu
            FROM tasks t WHERE t.node = want.node AND {{holds_slot}}
        ) used ON true
        WHERE n.id = ANY(held)
          AND n.labels @> ALL(want.selectors)
          AND used.n + want.n <= n.slots + n.prefetch
          AND used.cpu + want.cpu <= n.cpu + 1e-9
          AND used.memory_mb + want.memory_mb <= n.memory_mb
          AND used.gpu + want.gpu <= n.gpu;
        SELECT array_agg(m.id ORDER BY m.i), array_agg(m.version ORDER BY m.i),
               array_agg(m.from_status ORDER BY m.i), array_agg(m.to_status ORDER BY m.i),
               array_agg(m.reason ORDER BY m.i), array_agg(m.patch ORDER BY m.i)
        INTO m_ids, m_versions, m_from, m_to, m_reasons, m_patches
        FROM unnest(m_ids, m_versions, m_from, m_to, m_reasons, m_patches) WITH ORDINALITY
             AS m(id, version, from_status, to_status, reason, patch, i)
        WHERE m.id = ANY(fresh) AND m.patch::jsonb ->> 'node' = ANY(fit);
        IF m_ids IS NOT NULL THEN
            -- the moves, and each node told of its new attempts by this commit
            -- (`placed_payload`, from the rows the CAS moved): its executor claims them on
            -- it, ahead of the dispatch message that follows. A node given more than a
            -- notification lists is told by that message alone
            PERFORM pg_notify({{placed_channel(t.node)}}, {{placed_payload}})
            FROM sked_transition(m_ids, m_versions, m_from, m_to, m_reasons, m_patches,
                                 margin) t
            GROUP BY t.node
            HAVING count(*) <= 100;
        END IF;
    END IF;
    RETURN QUERY SELECT * FROM tasks t WHERE t.id = ANY(fresh);
END
$fn$

-- name: existing_tasks
-- The tasks these ids or idempotency keys already name (what an insert did not create).
SELECT {{task_columns()}} FROM tasks
WHERE id = ANY($1::uuid[]) OR idempotency_key = ANY($2::text[])

-- name: transition
-- The CAS (function sked_transition, defined by define_transition below): $1..$6 the moves'
-- columns (see there), $7 the lease margin.
SELECT {{task_columns()}}
FROM sked_transition($1::uuid[], $2::int[], $3::text[], $4::text[], $5::text[], $6::text[],
                     $7::float8)

-- name: transition_thin
-- The CAS as `transition`, for moves some of which want no row back: $8, per move, the
-- level of task_columns_at its row comes back at (2 for a move's fsm.Move.read_back).
SELECT {{task_columns_at(k.level)}}
FROM sked_transition($1::uuid[], $2::int[], $3::text[], $4::text[], $5::text[], $6::text[],
                     $7::float8)
JOIN unnest($1::uuid[], $8::int[]) AS k(kept_id, level) ON k.kept_id = id

-- name: define_transition
-- The CAS: each move applies only if the task is still at its version and state. `u.p` is
-- the move's patch (a key present sets its column). The event row and the NOTIFY go in the
-- same statement, so a state change and its event can never diverge. $7 is the lease margin.
-- Leases (docs/architecture.md, "At most one live attempt"): a move into Running takes one
-- for the attempt; a move out of Running that proves the process ended ends it; Paused and
-- Canceled keep it until the executor gives it back. Lost, and the start of a next attempt,
-- wait until the lease has run out by the margin — except a Lost reported by the lease's
-- holder itself (a cluster backend whose next launch fences the old attempt's pods). The
-- schedule deadline is set anew when the task enters Ready from a waiting state, never when
-- an attempt that held a slot comes back (so a task bouncing between Ready and Scheduling
-- still times out).
-- Why a function: planning this statement cost about as much as running it (~0.45 ms a
-- call, docs/performance.md). A PL/pgSQL function keeps its plan for the session; the plan
-- is generic from the first call and may not scan tasks sequentially, so a plan made while
-- the table was young and small stays right as it grows: no sequential scan, no hash or
-- merge join, and `t.status || ''` keeps the status index from serving a lookup by id (a
-- young table's plan chose it: 130 ms a call at 50,000 rows; tests/integration/test_migrate
-- checks the plan). `sked migrate` (re)defines the function from this text after the
-- migration files.
CREATE OR REPLACE FUNCTION sked_transition(
    uuid[], int[], text[], text[], text[], text[], float8
) RETURNS SETOF tasks
LANGUAGE plpgsql
{{planned_once}}
AS $fn$
BEGIN
RETURN QUERY
WITH u AS (
    SELECT id, version, from_status, to_status, reason, patch::jsonb AS p
    FROM unnest($1::uuid[], $2::int[], $3::text[], $4::text[], $5::text[], $6::text[])
         AS u(id, version, from_status, to_status, reason, patch)
), locked AS (
    {{locked_in_id_order(t.version = u.version AND t.status || '' = u.from_status)}}
), moved AS (
    UPDATE tasks t SET
        status = u.to_status,
        status_reason = u.reason,
        version = t.version + 1,
        updated_at = now(),
        attempt = COALESCE((u.p ->> 'attempt')::int, t.attempt),
        retry_count = COALESCE((u.p ->> 'retry_count')::int, t.retry_count),
        launch_failures = COALESCE((u.p ->> 'launch_failures')::int, t.launch_failures),
        node = CASE WHEN u.p ? 'node' THEN u.p ->> 'node' ELSE t.node END,
        next_retry_at = CASE WHEN u.p ? 'retry_in_s'
                             THEN now() + make_interval(secs => (u.p ->> 'retry_in_s')::float8)
                             ELSE t.next_retry_at END,
        result = CASE WHEN u.p ? 'result' THEN NULLIF(u.p -> 'result', 'null'::jsonb)
                      ELSE t.result END,
        error = CASE WHEN u.p ? 'error' THEN u.p ->> 'error' ELSE t.error END,
        log_tail = CASE WHEN u.p ? 'log_tail' THEN u.p ->> 'log_tail' ELSE t.log_tail END,
        inputs = CASE WHEN u.p ? 'inputs' THEN u.p -> 'inputs' ELSE t.inputs END,
        paused_by = CASE WHEN u.p ? 'paused_by' THEN u.p ->> 'paused_by' ELSE t.paused_by END,
        paused_reason = CASE WHEN u.p ? 'paused_reason' THEN u.p ->> 'paused_reason'
                             ELSE t.paused_reason END,
        paused_at = CASE WHEN u.to_status = 'paused' THEN now() ELSE t.paused_at END,
        -- back to Ready unstarted (a node's backlog handed back, a dispatch stuck): in its
        -- place in line, as its schedule deadline below
        queued_at = CASE WHEN u.to_status = 'ready' AND u.from_status NOT IN ({{slot_states}})
                         THEN now() ELSE t.queued_at END,
        schedule_deadline = CASE WHEN u.to_status = 'ready'
                                      AND u.from_status NOT IN ({{slot_states}})
                                 THEN now() + make_interval(secs => t.schedule_timeout_s)
                                 -- a launch failure (Running -> Ready: it never ran) gets back
                                 -- the time it had left when it started: the clock stops
                                 -- while an attempt holds a start, and a platform's slow
                                 -- failure must not fail the task as never started
                                 -- (greatest() passes over a NULL: a task without a
                                 -- deadline must keep none)
                                 WHEN u.to_status = 'ready' AND u.from_status = 'running'
                                      AND t.schedule_deadline IS NOT NULL
                                 THEN now() + greatest(t.schedule_deadline - t.started_at,
                                                       interval '0')
                                 ELSE t.schedule_deadline END,
        started_at = CASE WHEN u.to_status = 'running' THEN now() ELSE t.started_at END,
        hb_at = CASE WHEN u.to_status = 'running' THEN now() ELSE t.hb_at END,
        hb_deadline = CASE WHEN u.to_status = 'running'
                           THEN now() + make_interval(secs => t.heartbeat_timeout_s + $7)
                           ELSE t.hb_deadline END,
        hb_seq = CASE WHEN u.to_status = 'running' THEN 0 ELSE t.hb_seq END,
        lease_owner = CASE WHEN u.to_status = 'running' THEN (u.p ->> 'lease_owner')::uuid
                           WHEN {{ends_lease}} THEN NULL ELSE t.lease_owner END,
        lease_attempt = CASE WHEN u.to_status = 'running' THEN t.attempt
                             WHEN {{ends_lease}} THEN NULL ELSE t.lease_attempt END,
        lease_until = CASE WHEN u.to_status = 'running'
                           THEN now() + make_interval(secs => t.heartbeat_timeout_s)
                           WHEN {{ends_lease}} THEN NULL ELSE t.lease_until END,
        finished_at = CASE WHEN u.to_status IN ({{terminal_states}}, {{retryable_states}})
                           THEN now() ELSE t.finished_at END
    FROM locked u
    WHERE t.id = u.id AND t.version = u.version AND t.status || '' = u.from_status
      AND (u.to_status NOT IN ('lost', 'running') OR {{lease_over($7)}}
           OR (u.to_status = 'lost' AND t.lease_owner = (u.p ->> 'lease_owner')::uuid))
      -- no attempt is placed or starts past its schedule deadline, by this clock: the sweep
      -- that fails such a task may be behind, or down (services/scheduler/timeouts.py)
      AND (u.to_status NOT IN ('scheduling', 'running') OR t.schedule_deadline IS NULL
           OR t.schedule_deadline > now())
    RETURNING t AS task, u.from_status AS _from, u.reason AS _reason
), after AS (
    SELECT (task).* FROM moved
), ev AS (
    INSERT INTO task_events (task_id, from_status, to_status, version, attempt, reason)
    SELECT (task).id, _from, (task).status, (task).version, (task).attempt, _reason FROM moved
    RETURNING {{event_columns}}
), outbox AS ({{to_outbox(ev)}}
), note AS ({{notify(after)}}
), note_taken AS ({{notify_taken(after)}})
SELECT * FROM after
WHERE (SELECT count(*) FROM note) >= 0 AND (SELECT count(*) FROM note_taken) >= 0;
END
$fn$

-- fragment: planned_once
-- How the CAS functions are planned: once a session, generically, never by a sequential scan
-- or a hash or merge join (define_transition says why).
SET enable_seqscan = off
SET enable_mergejoin = off
SET enable_hashjoin = off
SET plan_cache_mode = force_generic_plan

-- name: get_task
-- One task by id.
SELECT {{task_columns()}} FROM tasks WHERE id = $1

-- name: get_task_json
-- One task by id as one JSON object: the CLI's synchronous read (shared.store.libpq takes a
-- single text value back; shared.store.quick turns it into a Task).
SELECT row_to_json(t)::text FROM (SELECT {{task_columns()}} FROM tasks WHERE id = $1::uuid) t

-- name: get_tasks
-- Tasks by id.
SELECT {{task_columns()}} FROM tasks WHERE id = ANY($1::uuid[])

-- name: still_placed
-- Of these tasks, those still Scheduling, with the attempt and node they are placed in
-- (services/scheduler/follow.py: placements no executor has claimed yet). By primary key.
SELECT id, attempt, node FROM tasks WHERE id = ANY($1::uuid[]) AND status = 'scheduling'

-- name: get_ready
-- Those of these tasks still Ready; `_fenced`: an earlier attempt still holds a lease (paused
-- while its executor could not hear it), so this one may not start yet. $2: the lease margin.
-- `status || ''` keeps the partial index tasks_runnable from serving this lookup by id: with
-- a young table's statistics the planner scanned every Ready task for the few asked for
-- (~3.4 ms a placement pass in a burst of 5,000, against ~0.3 by the primary key).
SELECT {{task_columns()}}, NOT {{lease_over($2)}} AS _fenced
FROM tasks t WHERE id = ANY($1::uuid[]) AND status || '' = 'ready'

-- name: ready_among
-- Which of these tasks are Ready (the parked sets' pruning; `|| ''` as in get_ready).
SELECT id FROM tasks WHERE id = ANY($1::uuid[]) AND status || '' = 'ready'

-- name: ready_for_queue
-- What the ready queue needs to (re)score Ready tasks queued more than $1 seconds ago, oldest
-- first, a page of $2 after ($3, $4): the reconciler reads only tasks a live scheduler would
-- have popped already.
SELECT id, priority, queued_at FROM tasks
WHERE status = 'ready' AND queued_at < now() - make_interval(secs => $1)
  AND (queued_at, id) > ($3::timestamptz, $4::uuid)
ORDER BY queued_at, id
LIMIT $2

-- name: set_wait_reasons
-- Why a Ready task waits (written only when the reason changes). A row another statement
-- holds is skipped: the reason is cosmetic, the holder is likely placing it right now, and
-- waiting for it here could deadlock with that holder's batch.
WITH u AS (SELECT * FROM unnest($1::uuid[], $2::text[]) AS u(id, reason)),
free AS (
    {{skip_locked_in_id_order(t.status = 'ready' AND t.status_reason IS DISTINCT FROM u.reason)}}
)
UPDATE tasks t SET status_reason = u.reason
FROM free u
WHERE t.id = u.id

-- name: terminal_among
-- Which of these tasks are terminal: ended outright, or failed with no retry left (the FSM's
-- is_terminal in SQL, so that waiters fetch only finished rows).
SELECT {{task_columns()}} FROM tasks
WHERE id = ANY($1::uuid[])
  AND {{has_ended()}}

-- name: list_tasks
-- Tasks of the states $1 (the caller passes every state for "any"), newest first, optionally
-- of one name ($2), at most $3; with $4, those after task $4 in that order (the last of the
-- previous page: keyset paging, so a page costs the same however deep, and tasks admitted
-- meanwhile shift nothing). The order is created_at descending, then id: a batch admitted in
-- one statement shares its created_at. Each state's newest are read from tasks_status_created
-- and merged, so the cost is that of $3 rows a state whatever the table holds; one ORDER BY
-- over the table (or status = ANY($1)) sorted every row of it: 200 ms at 300,000 tasks,
-- against ~2 ms this way. An unknown $4 yields no rows (the caller tells it from the end); a
-- $4 retention deleted since goes on from where it stood (its tombstone's created_at).
WITH c AS (
    SELECT created_at, id FROM tasks WHERE id = $4
    UNION ALL  -- deleted by retention since: where it stood, from its tombstone (0022)
    SELECT created_at, id FROM purged WHERE id = $4 AND created_at IS NOT NULL
    LIMIT 1
)
SELECT {{task_columns(t.)}}
FROM unnest($1::text[]) AS s(status)
CROSS JOIN LATERAL (
    SELECT * FROM tasks
    WHERE tasks.status = s.status AND ($2::text IS NULL OR tasks.name = $2)
      -- the index's bound, then the tie at the cursor's own instant
      AND tasks.created_at <= coalesce((SELECT created_at FROM c), 'infinity')
      AND ($4::uuid IS NULL
           OR tasks.created_at < (SELECT created_at FROM c)
           OR tasks.id > (SELECT id FROM c))
    ORDER BY tasks.created_at DESC, tasks.id
    LIMIT $3
) AS t
WHERE $4::uuid IS NULL OR EXISTS (SELECT FROM c)
ORDER BY t.created_at DESC, t.id
LIMIT $3

-- name: task_cursor_known
-- Whether a listing can page after task $1: it exists, or retention deleted it and its
-- tombstone tells where it stood (an empty page after it: unknown, or the last page).
SELECT EXISTS (SELECT FROM tasks WHERE id = $1)
       OR EXISTS (SELECT FROM purged WHERE id = $1 AND created_at IS NOT NULL)

-- name: history
-- A task's transitions, in version order.
SELECT {{event_columns}} FROM task_events WHERE task_id = $1 ORDER BY version

-- name: ended_with
-- Which of these (task, version while Running) attempts were ended by a move whose reason
-- starts with $3 (a failure's reason goes on with its error): an end this writer already
-- applied, seen again after its COMMIT reply was lost.
SELECT e.task_id FROM task_events e
JOIN unnest($1::uuid[], $2::int[]) AS u(id, version)
  ON e.task_id = u.id AND e.version = u.version + 1
WHERE e.from_status = 'running' AND starts_with(e.reason, $3)

-- name: next_retry_due
-- Seconds until the earliest retry is due, by Postgres's clock (NULL: no task waits).
SELECT extract(epoch FROM min(next_retry_at) - now())::float8 FROM tasks
WHERE status = 'retry_wait'

-- name: next_schedule_deadline
-- Seconds until the earliest schedule timeout of a task waiting to start runs out, by
-- Postgres's clock (NULL: no waiting task has one).
SELECT extract(epoch FROM min(schedule_deadline) - now())::float8 FROM tasks
WHERE status IN ({{awaits_start_states}}) AND schedule_deadline IS NOT NULL

-- name: lock_workflow_priorities
-- Serialises the priority changes of one workflow ($1), so two never mix stale own priorities.
SELECT pg_advisory_xact_lock(hashtextextended($1::text, 7))

-- name: workflow_priorities
-- Each task of a workflow with its effective and its own priority.
SELECT id, wf_task, priority, (spec ->> 'priority')::int AS own FROM tasks WHERE workflow_id = $1

-- name: set_priorities
-- Priority changes (not a state change: no version bump, no event), rows locked in id order:
-- the task's own priority ($3, $4) goes into its spec, each effective priority into `priority`.
-- Only tasks that have not ended, as they stand once locked (a row updated meanwhile is
-- judged again, newest): the caller's read is older, and one that ended keeps its priority.
WITH u AS (SELECT * FROM unnest($1::uuid[], $2::int[]) AS u(id, priority)),
locked AS ({{locked_in_id_order(true)}})
UPDATE tasks t SET
    priority = u.priority,
    spec = CASE WHEN t.id = $3 THEN jsonb_set(t.spec, '{priority}', to_jsonb($4::int))
                ELSE t.spec END
FROM locked u
WHERE t.id = u.id AND NOT {{has_ended(t.)}}
RETURNING {{task_columns(t.)}}
