-- Degrade modes (shared/degrade.py): one row every scheduler replica obeys. Changed by CAS on
-- `version`; a mode ends by itself at `until` (Postgres time; NULL: until lifted).
CREATE TABLE degrade (
    id        boolean PRIMARY KEY DEFAULT true CHECK (id),
    mode      text NOT NULL DEFAULT 'normal' CHECK (mode IN ('normal', 'partial', 'full')),
    automatic boolean NOT NULL DEFAULT false,
    reason    text NOT NULL DEFAULT '',
    set_by    text NOT NULL DEFAULT '',
    since     timestamptz NOT NULL DEFAULT now(),
    until     timestamptz,
    version   integer NOT NULL DEFAULT 1
);
INSERT INTO degrade DEFAULT VALUES;
