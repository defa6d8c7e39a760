-- A task's W3C trace context (its producer's span), so every service's spans for the task
-- join one trace.
ALTER TABLE tasks ADD COLUMN traceparent text;
