-- An attempt's late result is recorded once: a finish write retried after its COMMIT's reply
-- was lost ran its INSERT again and recorded the same attempt twice (record_late_results now
-- skips what is there). The copies already recorded go, the first of each kept.
DELETE FROM late_results l
USING late_results k
WHERE k.task_id = l.task_id AND k.attempt = l.attempt AND k.id < l.id;

CREATE UNIQUE INDEX late_results_attempt ON late_results (task_id, attempt);
-- it leads with task_id: it serves what the index by task alone served (the cascade from tasks)
DROP INDEX late_results_task;
