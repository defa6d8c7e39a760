-- An attempt paused or canceled while its executor could not hear it runs on until its lease
-- ends or its executor releases it (release_leases): meanwhile it still holds its node's slot
-- and resources and its workflow's named resources (fragment holds_slot). Such rows are few;
-- this index finds them for every read of what the nodes hold.
CREATE INDEX tasks_lease_held ON tasks (node, lease_until)
    WHERE lease_until IS NOT NULL AND status NOT IN ('scheduling', 'running');
