"""`sked token`: the operator API's bearer tokens. Always straight to the database: whoever may
make tokens has its URL (the first token cannot come from the API it unlocks).

sked token create --role read|operate|admin [--name NAME] [--json]   the secret, once
sked token revoke NAME
sked token list [--json]
sked token audit [--limit N] [--token NAME] [--json]    what was changed through the API
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from services.cli.output import print_json, run
from shared.errors import NotFound
from shared.redact import printable

if TYPE_CHECKING:
    from shared.store import Store

# shared.auth.Role's values, named here so that building the parser loads no hashing
# (tests/unit/test_cli_imports.py holds the two lists equal)
ROLES = ("read", "operate", "admin")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("token", help="operator API tokens: create, revoke, list, audit")
    actions = p.add_subparsers(dest="token_action", required=True, metavar="ACTION")
    c = actions.add_parser("create", help="make a token; prints its secret, once")
    c.add_argument("--role", required=True, choices=ROLES)
    c.add_argument("--name", help="default: <role>-<random>; never reused")
    c.add_argument("--json", action="store_true")
    r = actions.add_parser("revoke", help="revoke a token: it authenticates nothing from now on")
    r.add_argument("name")
    r.add_argument("--json", action="store_true")
    ls = actions.add_parser("list", help="every token, revoked ones too (never a secret)")
    ls.add_argument("--json", action="store_true")
    a = actions.add_parser("audit", help="the latest changes made through the API")
    a.add_argument("--limit", type=int, default=50)
    a.add_argument("--token", help="only this token's")
    a.add_argument("--json", action="store_true")
    p.set_defaults(func=lambda args: run(_token(args)))


def _when(at: Any) -> str:
    return "-" if at is None else at.isoformat(timespec="seconds")


async def _token(args: argparse.Namespace) -> int:
    from shared.settings import Settings
    from shared.store import Store

    s = Settings()
    store = await Store.connect(s.database_url, 2, s.lease_margin_s, s.node_ttl_s)
    try:
        return await _act(store, args)
    finally:
        await store.close()


async def _act(store: Store, args: argparse.Namespace) -> int:
    if args.token_action == "create":
        from shared.auth import Role

        row, secret = await store.tokens.issue(Role(args.role), args.name)
        if args.json:
            print_json({"token": row.as_json(), "secret": secret})
        else:
            print(secret)
            shown = f"token {row.name} ({row.role.value}): its secret is shown only now"
            print(shown, file=sys.stderr)
        return 0
    if args.token_action == "revoke":
        revoked = await store.tokens.revoke(args.name)
        if revoked is None:
            raise NotFound(f"no token {args.name!r}")
        if args.json:
            print_json(revoked.as_json())
        else:
            print(f"token {revoked.name} revoked at {_when(revoked.revoked_at)}")
        return 0
    if args.token_action == "list":
        tokens = await store.tokens.all()
        if args.json:
            print_json([t.as_json() for t in tokens])
        for t in [] if args.json else tokens:
            state = f"revoked {_when(t.revoked_at)}" if t.revoked_at else "live"
            made, used = _when(t.created_at), _when(t.last_used_at)
            print(f"{t.name:<24} {t.role.value:<8} created {made}  used {used}  {state}")
        return 0
    rows = await store.tokens.audit_log(args.limit, args.token)
    if args.json:
        print_json([r.as_json() for r in rows])
    for e in [] if args.json else rows:
        print(f"{_when(e.at)}  {e.token:<20} {e.action:<16} {printable(f'{e.target}  {e.detail}')}")
    return 0
