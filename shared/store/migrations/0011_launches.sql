-- Launches: a backend that runs attempts as objects in another system (a Kubernetes Job)
-- records each attempt's object once it exists, so that it is never created twice (an attempt
-- whose recorded Job vanished is lost, not launched again), a create that meets an existing
-- object adopts it only when its uid is the recorded one, and an executor that restarts finds
-- the attempts it launched (`executor`: the executor's node id) and follows them again.
CREATE TABLE launches (
    task_id    uuid NOT NULL REFERENCES tasks (id) ON DELETE CASCADE,
    attempt    integer NOT NULL,
    name       text NOT NULL,
    uid        text NOT NULL,
    executor   text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (task_id, attempt)
);
CREATE INDEX launches_executor ON launches (executor);

-- Launch failures (the attempt never started: unschedulable, image pull back-off) send the
-- task back to Ready without spending a retry, at most max_launch_failures times.
ALTER TABLE tasks ADD COLUMN launch_failures integer NOT NULL DEFAULT 0
    CHECK (launch_failures >= 0);
ALTER TABLE tasks ADD COLUMN max_launch_failures integer NOT NULL DEFAULT 3
    CHECK (max_launch_failures >= 0);
