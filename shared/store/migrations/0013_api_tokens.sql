-- The operator API (services/api): bearer tokens, the audit of what they changed, and node
-- cordons.

-- A token's secret is never stored: only its SHA-256 (shared/auth.py says why a plain hash is
-- enough for a random 256-bit secret). Names are never reused, so the audit stays unambiguous.
CREATE TABLE api_tokens (
    name          text PRIMARY KEY CHECK (name ~ '^[A-Za-z0-9][A-Za-z0-9_.@-]{0,62}$'),
    role          text NOT NULL CHECK (role IN ('read', 'operate', 'admin')),
    secret_sha256 text NOT NULL UNIQUE CHECK (secret_sha256 ~ '^[0-9a-f]{64}$'),
    created_at    timestamptz NOT NULL DEFAULT now(),
    revoked_at    timestamptz,
    last_used_at  timestamptz
);

-- Every change made through the API, by token: submissions included (a task's own events
-- name the token for pause, resume and cancel).
CREATE TABLE api_audit (
    id     bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at     timestamptz NOT NULL DEFAULT now(),
    token  text NOT NULL,
    action text NOT NULL,
    target text NOT NULL,
    detail text NOT NULL DEFAULT ''
);
CREATE INDEX api_audit_at ON api_audit (at);

-- A cordoned node takes no new work (its running work is untouched); registering again and
-- heartbeats leave a cordon as it is: only an uncordon lifts it.
ALTER TABLE nodes
    ADD COLUMN cordoned_at   timestamptz,
    ADD COLUMN cordoned_by   text,
    ADD COLUMN cordon_reason text;
