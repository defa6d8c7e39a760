-- An automatic degrade mode ends early once its cause has been gone SKED_DEGRADE_CALM_S: since
-- when the evaluator has seen it gone (Postgres time; NULL: the cause holds, or no automatic
-- mode). Any change of mode clears it.
ALTER TABLE degrade ADD COLUMN calm_since timestamptz;

-- A node whose executor stopped cleanly (Postgres time; NULL: serving, or it went away
-- without saying so). The healthy-nodes trigger does not count it: scaling executors down,
-- or restarting them one by one, is not a cluster losing its nodes. Cleared when an executor
-- serves the node again.
ALTER TABLE nodes ADD COLUMN left_at timestamptz;
