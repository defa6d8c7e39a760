-- Tombstones (services/recovery's retention): the id of each task and workflow retention
-- deleted, and when. A read of one then says it was deleted, and a wait for one ends with that,
-- instead of answering as for an id never admitted (which a wait waits for: its submission may
-- still be on its way). A tombstone goes itself one retention later.
CREATE TABLE purged (
    id        uuid PRIMARY KEY,
    purged_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX purged_at ON purged (purged_at);
