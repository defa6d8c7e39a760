"""Operator API tokens: roles, secrets and how they are checked (pure: no I/O).

A token is a name, a role and a secret. The secret is shown once, when the token is made
(`sked token create`), and only its SHA-256 is stored. A plain, unsalted hash is enough here,
unlike for passwords: the secret is 32 random bytes (256 bits) chosen by us, not by a person, so
there is no dictionary to try and no preimage to search for — a slow KDF (bcrypt, argon2) would
cost every request milliseconds and buy nothing. A stolen table gives no usable token. The
server looks a presented token up by its hash (an index), never compares secrets itself.

Roles are ordered: `read` (every GET) < `operate` (submit, pause, resume, cancel, priority,
cordon, drain) < `admin` (tokens).
"""

from __future__ import annotations

import hashlib
import re
import secrets
from enum import StrEnum

from shared.errors import InvalidSpec

PREFIX = "sked_"  # tells a sked token apart in a config file or a leaked-secret scan
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,62}$")  # as the api_tokens.name check


class Role(StrEnum):
    READ = "read"
    OPERATE = "operate"
    ADMIN = "admin"

    @property
    def rank(self) -> int:
        return list(Role).index(self)

    def allows(self, needed: Role) -> bool:
        """Whether a token of this role may make a call that needs `needed`."""
        return self.rank >= needed.rank


def new_secret() -> str:
    """A fresh token secret: 32 random bytes, URL-safe, with a recognisable prefix."""
    return PREFIX + secrets.token_urlsafe(32)


def digest(secret: str) -> str:
    """What is stored of a secret, and how a presented one is looked up."""
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


def default_name(role: Role) -> str:
    return f"{role.value}-{secrets.token_hex(4)}"


def check_name(name: str) -> str:
    if not NAME.fullmatch(name):  # match() would take "ci\n": $ matches before a last \n
        raise InvalidSpec(
            f"a token name is 1-63 letters, digits or _.@- (starting with a letter or digit): "
            f"{name!r}"
        )
    return name


def bearer(header: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, or None."""
    if not header:
        return None
    scheme, _, value = header.strip().partition(" ")
    value = value.strip()
    if scheme.lower() != "bearer" or not value:
        return None
    # a secret is ASCII (sked_ and URL-safe base64); aiohttp keeps a header's undecodable
    # bytes as lone surrogates, which no digest could encode: such a value is no token
    if not (value.isascii() and value.isprintable()):
        return None
    return value
