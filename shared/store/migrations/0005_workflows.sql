-- Workflows: a DAG of tasks submitted together. A task's dependencies are rows of task_deps;
-- whether a task may run is decided from its upstreams' states under its own row lock, so
-- two upstreams finishing at once release it exactly once.

CREATE TABLE workflows (
    id         uuid PRIMARY KEY,
    name       text NOT NULL,
    spec       jsonb NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);

ALTER TABLE tasks ADD COLUMN workflow_id uuid REFERENCES workflows (id) ON DELETE CASCADE;
ALTER TABLE tasks ADD COLUMN wf_task text;
CREATE INDEX tasks_workflow ON tasks (workflow_id) WHERE workflow_id IS NOT NULL;

CREATE TABLE task_deps (
    task_id     uuid NOT NULL REFERENCES tasks (id) ON DELETE CASCADE,
    upstream_id uuid NOT NULL REFERENCES tasks (id) ON DELETE CASCADE,
    condition   text NOT NULL CHECK (condition IN ('on_success', 'on_failure', 'always')),
    PRIMARY KEY (task_id, upstream_id)
);
CREATE INDEX task_deps_upstream ON task_deps (upstream_id);
