"""Operator API tokens (only each secret's SHA-256: shared/auth.py says why) and the audit of
what the API changed, by token."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from shared.auth import Role, check_name, default_name, digest, new_secret
from shared.errors import SkedError
from shared.store.db import Db
from shared.store.queries import Q

# last_used_at is written at most this often per token: a busy client costs no write per call
TOUCH_EVERY_S = 60.0


class NameTaken(SkedError):
    """A token of that name exists (names are never reused: the audit names tokens)."""


@dataclass(frozen=True)
class TokenRow:
    name: str
    role: Role
    created_at: datetime
    revoked_at: datetime | None
    last_used_at: datetime | None

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> TokenRow:
        return cls(
            name=row["name"],
            role=Role(row["role"]),
            created_at=row["created_at"],
            revoked_at=row["revoked_at"],
            last_used_at=row["last_used_at"],
        )

    def as_json(self) -> dict[str, Any]:
        def when(at: datetime | None) -> str | None:
            return None if at is None else at.isoformat()

        return {
            "name": self.name,
            "role": self.role.value,
            "created_at": self.created_at.isoformat(),
            "revoked_at": when(self.revoked_at),
            "last_used_at": when(self.last_used_at),
        }


@dataclass(frozen=True)
class AuditRow:
    id: int
    at: datetime
    token: str
    action: str
    target: str
    detail: str

    def as_json(self) -> dict[str, Any]:
        return {**vars(self), "at": self.at.isoformat()}


class Tokens:
    def __init__(self, db: Db) -> None:
        self.db = db

    async def issue(self, role: Role, name: str | None = None) -> tuple[TokenRow, str]:
        """A new token with a fresh secret: (its row, the secret, to be shown once)."""
        secret = new_secret()
        row = await self.create(check_name(name or default_name(role)), role, digest(secret))
        return row, secret

    async def create(self, name: str, role: Role, secret_sha256: str) -> TokenRow:
        row = await self.db.fetchrow(Q.create_token, name, role.value, secret_sha256)
        if row is None:
            raise NameTaken(f"a token named {name!r} exists already (names are never reused)")
        return TokenRow.from_row(row)

    async def revoke(self, name: str) -> TokenRow | None:
        """Revoke the token; None if there is none of that name."""
        row = await self.db.fetchrow(Q.revoke_token, name)
        return None if row is None else TokenRow.from_row(row)

    async def all(self) -> list[TokenRow]:
        return [TokenRow.from_row(r) for r in await self.db.fetch(Q.list_tokens)]

    async def authenticate(self, secret_sha256: str) -> TokenRow | None:
        """The live token with this secret hash (and note that it was used), or None."""
        row = await self.db.fetchrow(Q.authenticate_token, secret_sha256, TOUCH_EVERY_S)
        return None if row is None else TokenRow.from_row(row)

    async def audit(self, token: str, action: str, target: str, detail: str = "") -> None:
        await self.db.execute(Q.record_audit, token, action, target, detail)

    async def audit_log(self, limit: int = 100, token: str | None = None) -> list[AuditRow]:
        rows = await self.db.fetch(Q.read_audit, limit, token)
        return [AuditRow(**dict(r)) for r in rows]
