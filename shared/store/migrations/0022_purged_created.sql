-- A tombstone keeps its deleted row's created_at (NULL for those written before): a listing
-- paged by the id of a task or workflow retention deleted since goes on from where that row
-- stood, where it answered 404 (list_tasks, list_workflows). Adding a nullable column without
-- a default rewrites nothing.
ALTER TABLE purged ADD COLUMN created_at timestamptz;
