-- Nodes: executors register and refresh themselves; placement reads them with their usage. A
-- node's usage is not a counter that could drift: it is the sum over the tasks that hold it.

-- name: register_node
-- Insert or refresh a node (a restarted executor takes its node over with a new boot id), and
-- tell the schedulers (NOTIFY sked_node: parked tasks may fit now). A cordon is left as it is:
-- only `uncordon_node` lifts it.
WITH up AS (
    INSERT INTO nodes (id, slots, cpu, memory_mb, gpu, labels, ready, boot_id, prefetch)
    VALUES ($1, $2, $3, $4, $5, $6::jsonb, true, $7, $8)
    ON CONFLICT (id) DO UPDATE SET
        slots = EXCLUDED.slots, prefetch = EXCLUDED.prefetch, cpu = EXCLUDED.cpu,
        memory_mb = EXCLUDED.memory_mb,
        gpu = EXCLUDED.gpu, labels = EXCLUDED.labels, ready = true, boot_id = EXCLUDED.boot_id,
        registered_at = now(), heartbeat_at = now(), left_at = NULL
    RETURNING id
)
SELECT pg_notify('sked_node', id) FROM up

-- name: node_heartbeat
-- An executor's heartbeat, which also re-asserts that it is ready (a monitor may have marked
-- it not ready while it was only reconnecting) and the backlog it holds now ($4; NULL: as it
-- is); nothing if another executor took the node over. A node that comes back (not ready, or
-- silent past the TTL $5, before this beat) is told to the schedulers (NOTIFY sked_node):
-- tasks parked while it was away, for want of a node only it matches, may fit now.
WITH up AS (
    UPDATE nodes n SET heartbeat_at = now(), load = $3, ready = true, left_at = NULL,
                       prefetch = COALESCE($4::int, n.prefetch)
    FROM nodes old  -- the row as this statement found it
    WHERE n.id = $1 AND n.boot_id = $2 AND old.id = n.id
    RETURNING n.id, n.ready,
              NOT old.ready OR old.heartbeat_at < now() - make_interval(secs => $5) AS back
)
SELECT ready, CASE WHEN back THEN pg_notify('sked_node', id) END AS told FROM up

-- name: set_node_prefetch
-- The backlog a node holds changed (shared/backlog.py): placement sees it from its next pass,
-- and the schedulers are told (a node that takes a backlog again has room now).
WITH up AS (
    UPDATE nodes SET prefetch = $3 WHERE id = $1 AND boot_id = $2 AND prefetch <> $3
    RETURNING id
)
SELECT pg_notify('sked_node', id) FROM up

-- name: set_node_ready
-- Mark a node ready or not (draining; no executor connected), and tell the schedulers.
WITH up AS (
    UPDATE nodes SET ready = $3, heartbeat_at = now() WHERE id = $1 AND boot_id = $2
    RETURNING id
)
SELECT pg_notify('sked_node', id) FROM up

-- name: leave_node
-- Its executor stops cleanly: not ready, and left (the healthy-nodes trigger does not count
-- it); tell the schedulers.
WITH up AS (
    UPDATE nodes SET ready = false, heartbeat_at = now(), left_at = now()
    WHERE id = $1 AND boot_id = $2
    RETURNING id
)
SELECT pg_notify('sked_node', id) FROM up

-- name: nodes_with_usage
-- Every node with its usage, as placement reads it but without its locks (function
-- sked_nodes, defined by define_nodes below; $1 the live TTL).
SELECT * FROM sked_nodes($1::float8, false)

-- name: lock_and_read_nodes
-- Placement's read: the live nodes' rows locked, then every node with its usage, in one round
-- trip (function sked_nodes, defined by define_nodes below; $1 the live TTL).
SELECT * FROM sked_nodes($1::float8, true)

-- name: define_nodes
-- Every node with its usage: the attempts that hold it (holds_slot: Scheduling or Running
-- there, or running on past a pause or cancel until their leases end) and what they asked
-- for; `live`: it heartbeat within ttl_s seconds. Each row also carries the degrade
-- mode and the seconds left until its end (Postgres's clock): placement reads it with the
-- usage, at the same snapshot, rather than by another round trip. With `lock`, the live
-- nodes' rows are locked first, in id order: placement runs with them locked, so two
-- schedulers placing at once serialise here and each sees the other's reservations; and
-- only the nodes locked count as live (one that turned live between the lock and the read
-- waits for the next pass rather than being placed on unlocked). A cordoned node keeps
-- `live` as read, so that a task only it could take says why it waits. The usage is read
-- after the locks are granted, by a statement of its own: at READ COMMITTED a statement
-- reads as of its own start, so usage read by the statement that waited for a lock would
-- miss what the previous holder committed. In a PL/pgSQL function (volatile) each statement
-- takes a snapshot of its own, so both run in one call: one round trip, not two (~0.2 ms fewer a placement here, docs/performance.md). A cordoned node is not
-- placed on, so not locked: a cordon waits for a pass holding the row and the row, re-checked
-- once its lock is granted, drops out of every pass after it.
-- How it is planned (measured here, docs/performance.md, the eleventh session): one generic
-- plan per session, as sked_transition, since planning the usage read afresh each call cost
-- more than running it (0.92 -> 0.38 ms a locked call); no bitmap scans, since the usage is
-- read through tasks_active_by_node, a partial index every attempt enters and leaves, and a
-- bitmap scan cannot mark the entries of tasks that moved on as dead: it visited their heap
-- pages again on every call until a vacuum (1,053 pages, ~1 ms a placement after 5,500
-- tasks), where a plain index scan marks them and later scans step over them; no sequential
-- scan, so that the plan made on a young table still fits a large one; and no JIT, which a
-- plan costed past jit_above_cost (a disabled scan type is costed so: the degrade table has
-- no index) would spend ~200 ms a call on.
CREATE OR REPLACE FUNCTION sked_nodes(ttl_s float8, lock boolean)
RETURNS TABLE (
    id text, slots int, prefetch int, cpu float8, memory_mb bigint, gpu int, labels jsonb,
    ready boolean, load float8, boot_id uuid, registered_at timestamptz,
    heartbeat_at timestamptz, cordoned_at timestamptz, cordoned_by text, cordon_reason text,
    live boolean, used_slots bigint, used_cpu float8, used_memory_mb numeric, used_gpu bigint,
    degrade_mode text, degrade_remaining_s float8
)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
SET enable_bitmapscan = off
SET enable_seqscan = off
SET jit = off
AS $fn$
#variable_conflict use_column
DECLARE
    held text[] := '{}';
BEGIN
    IF lock THEN
        SELECT COALESCE(array_agg(l.id), '{}') INTO held FROM (
            SELECT n.id FROM nodes n
            WHERE n.ready AND n.heartbeat_at > now() - make_interval(secs => ttl_s)
                  AND n.cordoned_at IS NULL
            ORDER BY n.id
            FOR UPDATE
        ) l;
    END IF;
    RETURN QUERY
    SELECT n.id, n.slots, n.prefetch, n.cpu, n.memory_mb, n.gpu, n.labels, n.ready, n.load,
           n.boot_id, n.registered_at, n.heartbeat_at, n.cordoned_at, n.cordoned_by,
           n.cordon_reason,
           n.heartbeat_at > now() - make_interval(secs => ttl_s)
               AND (NOT lock OR n.id = ANY(held) OR n.cordoned_at IS NOT NULL),
           COALESCE(u.used_slots, 0), COALESCE(u.used_cpu, 0),
           COALESCE(u.used_memory_mb, 0), COALESCE(u.used_gpu, 0),
           d.mode, EXTRACT(EPOCH FROM d.until - now())::float8
    FROM nodes n
    LEFT JOIN degrade d ON true
    LEFT JOIN (
        -- holds_slot in two reads, each a plain index scan of its partial index (a bitmap
        -- scan, which an OR makes, revisits the heap pages of entries that moved on)
        SELECT h.node, count(*) AS used_slots, sum(h.cpu) AS used_cpu,
               sum(h.memory_mb) AS used_memory_mb, sum(h.gpu) AS used_gpu
        FROM (
            SELECT t.node, t.cpu, t.memory_mb, t.gpu FROM tasks t
            WHERE t.status IN ({{slot_states}})
            UNION ALL
            SELECT t.node, t.cpu, t.memory_mb, t.gpu FROM tasks t WHERE {{held_past_stop}}
        ) h GROUP BY h.node
    ) u ON u.node = n.id
    ORDER BY n.id;
END
$fn$

-- name: cordon_node
-- Cordon a node: it takes no new work. A node cordoned already keeps its first cordon (when,
-- by whom, why). Nothing else changes: what runs there runs on. Returns the node's id, or
-- nothing for an unknown node. (The row lock waits for a placement pass holding it.)
UPDATE nodes SET cordoned_at = COALESCE(cordoned_at, now()),
                 cordoned_by = CASE WHEN cordoned_at IS NULL THEN $2 ELSE cordoned_by END,
                 cordon_reason = CASE WHEN cordoned_at IS NULL THEN $3 ELSE cordon_reason END
WHERE id = $1
RETURNING id

-- name: uncordon_node
-- Lift a node's cordon and tell the schedulers (NOTIFY sked_node: tasks parked because no
-- node could take them may fit now). Returns the node's id, or nothing for an unknown node.
WITH up AS (
    UPDATE nodes SET cordoned_at = NULL, cordoned_by = NULL, cordon_reason = NULL
    WHERE id = $1
    RETURNING id
), note AS (SELECT pg_notify('sked_node', id) FROM up)
SELECT up.id, (SELECT count(*) FROM note) AS _notified FROM up

-- name: node_holders
-- The attempts that hold a node (holds_slot: Scheduling or Running on it, or paused or canceled
-- there and running on until their leases end): what a drain waits for.
SELECT t.id FROM tasks t WHERE t.node = $1 AND {{holds_slot}} ORDER BY t.id

-- name: forget_nodes
-- Nodes gone $1 seconds or longer (no heartbeat, by Postgres's clock) that hold no attempt
-- and are not cordoned (an operator's cordon must outlive the node's absence), deleted: every
-- placement reads every node row. A node placement could still use is live, so never gone
-- this long; an executor that comes back registers its row anew (the row lock orders a
-- registration and this delete: whichever is second sees the other's result). Returns the ids.
DELETE FROM nodes n
WHERE n.heartbeat_at < now() - make_interval(secs => $1)
  AND n.cordoned_at IS NULL
  AND NOT EXISTS (SELECT 1 FROM tasks t WHERE t.node = n.id AND {{holds_slot}})
RETURNING n.id

-- name: node_owner
-- The boot id a node's row names as its owner; no row: none (never registered, or forgotten).
SELECT boot_id FROM nodes WHERE id = $1
