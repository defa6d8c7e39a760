-- Operator API tokens (only each secret's SHA-256 is stored) and the audit of API changes.

-- fragment: token_columns
name, role, created_at, revoked_at, last_used_at

-- name: create_token
-- A new token; nothing if the name is taken (a name is never reused, revoked or not).
INSERT INTO api_tokens (name, role, secret_sha256) VALUES ($1, $2, $3)
ON CONFLICT (name) DO NOTHING
RETURNING {{token_columns}}

-- name: revoke_token
-- Revoke a token by name: from now on it authenticates nothing. A token revoked already keeps
-- its first revocation time. Nothing for an unknown name.
UPDATE api_tokens SET revoked_at = COALESCE(revoked_at, now()) WHERE name = $1
RETURNING {{token_columns}}

-- name: list_tokens
-- Every token, revoked ones too, oldest first (never a secret: only its hash is stored).
SELECT {{token_columns}} FROM api_tokens ORDER BY created_at, name

-- name: authenticate_token
-- The live (unrevoked) token whose secret hashes to $1, if any. Its last_used_at is written
-- at most once per $2 seconds, so that a busy client does not cost a write per request.
WITH t AS (
    SELECT {{token_columns}} FROM api_tokens WHERE secret_sha256 = $1 AND revoked_at IS NULL
), touch AS (
    UPDATE api_tokens a SET last_used_at = now() FROM t
    WHERE a.name = t.name
      AND (t.last_used_at IS NULL OR t.last_used_at < now() - make_interval(secs => $2))
    RETURNING a.name
)
SELECT t.*, (SELECT count(*) FROM touch) AS _touched FROM t

-- name: record_audit
-- One change made through the API: which token, what action, on what, and any detail.
INSERT INTO api_audit (token, action, target, detail) VALUES ($1, $2, $3, $4)

-- name: read_audit
-- The latest API changes, newest first; only those of token $2 when it is given.
SELECT id, at, token, action, target, detail FROM api_audit
WHERE ($2::text IS NULL OR token = $2)
ORDER BY id DESC
LIMIT $1
