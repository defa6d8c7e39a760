-- The outbox apart from the history: a row a relay deletes once the broker confirmed it, where
-- it used to mark the event row published.
--
-- Marking cost more than anything else the relay does (docs/performance.md): setting
-- published_at, a column the partial index task_events_unpublished is written over, could
-- never be a HOT update, so every event row was written twice with an entry in each of its
-- indexes both times, and the marked rows' dead entries stayed in the partial index, walked by
-- every read, until a vacuum. Now each transition writes its event row once (the history,
-- never touched again) and an outbox row carrying the event as JSON; the relay reads the
-- outbox in id order and deletes what it published, in the same transaction as before. A
-- task's outbox rows are inserted in version order, each by the statement that made the
-- move, after the previous move committed, so id order is version order for every task, as
-- the event ids were.

-- Upgrading: stop schedulers and relays of an older version before this runs (an old relay
-- reads published_at; an old scheduler's admissions would write no outbox rows): see
-- docs/architecture.md, "Migrations".

CREATE TABLE outbox (
    id        bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    task_id   uuid NOT NULL,
    -- a relay drains the shards it locked (outbox_shards): a task's rows are always in one
    shard     smallint NOT NULL GENERATED ALWAYS AS (get_byte(uuid_send(task_id), 15) % 16) STORED,
    to_status text NOT NULL,
    at        timestamptz NOT NULL,  -- the event's time: the relay's lag is measured from it
    body      text NOT NULL          -- the event as models.Event's JSON, rendered once
);

-- Events not yet relayed when this migration runs move to the new outbox, in their order.
INSERT INTO outbox (task_id, to_status, at, body)
SELECT task_id, to_status, at,
       json_build_object('id', id, 'task_id', task_id, 'from_status', from_status,
                         'to_status', to_status, 'version', version, 'attempt', attempt,
                         'reason', reason, 'at', at)::text
FROM task_events WHERE published_at IS NULL
ORDER BY id;

-- The history keeps what a reader asks of it: its columns, and UNIQUE (task_id, version), its
-- key. The event id stays (it is in every relayed event) but nothing looks a row up by it any
-- more, so it is no longer indexed: one index entry fewer per event.
ALTER TABLE task_events DROP COLUMN published_at;  -- and the partial index over it
ALTER TABLE task_events DROP COLUMN shard;
ALTER TABLE task_events DROP CONSTRAINT task_events_pkey;
