-- What a workflow task receives from its upstreams, fixed when it is released (Pending ->
-- Ready): {upstream name: its output} for each upstream that succeeded, or the edge's default
-- where a wait timed out under policy 'default'. NULL for a task outside a workflow.
ALTER TABLE tasks ADD COLUMN inputs jsonb;
