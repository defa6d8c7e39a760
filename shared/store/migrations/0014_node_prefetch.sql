-- A node's backlog (SKED_PREFETCH): dispatches placed on it beyond its slots, which its executor
-- holds unstarted (still Scheduling) and starts the moment a slot frees, so a slot's next
-- attempt does not wait for a round through the scheduler. 0: no backlog (as before).
ALTER TABLE nodes ADD COLUMN prefetch integer NOT NULL DEFAULT 0 CHECK (prefetch >= 0);
