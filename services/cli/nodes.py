"""`sked node`: cordon, uncordon and drain a node (shared/cordon.py). Through the operator API
when SKED_API_URL and SKED_API_TOKEN are set (the token is recorded as who), else straight to
the database.

sked node cordon NODE [--reason TEXT] [--by WHO] [--json]     no new work there
sked node uncordon NODE [--json]
sked node drain NODE [--timeout SECONDS] [--reason TEXT] [--by WHO] [--json]
                     cordon, then wait until nothing runs there: exit 0 drained, 1 not yet
                     (or uncordoned by someone else meanwhile: it takes work again)
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from services.cli.output import print_json, run, seconds
from shared.redact import printable

if TYPE_CHECKING:
    from shared.cordon import Drain
    from shared.store import NodeRow


def add_parser(sub: Any) -> None:
    p = sub.add_parser("node", help="cordon, uncordon or drain a node")
    p.add_argument("action", choices=["cordon", "uncordon", "drain"])
    p.add_argument("node")
    p.add_argument("--reason", default="")
    p.add_argument("--by", help="who is acting (default: user@host; through the API: the token)")
    p.add_argument("--timeout", type=seconds, help="drain: give up waiting after SECONDS")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=lambda a: run(_node(a)))


def state_of(n: NodeRow) -> str:
    """How `sked nodes` and `sked node` show a node's state."""
    if not n.live:
        return "gone"
    if n.cordoned_at is not None:
        return "cordoned"
    return "ready" if n.ready else "draining"


def _show(n: NodeRow, as_json: bool) -> None:
    if as_json:
        print_json(n.as_json())
    elif n.cordoned_at is not None:
        why = f": {n.cordon_reason}" if n.cordon_reason else ""
        print(printable(f"{n.id} cordoned by {n.cordoned_by} at {n.cordoned_at.isoformat()}{why}"))
    else:
        print(printable(f"{n.id} {state_of(n)}: takes new work"))


async def _node(args: argparse.Namespace) -> int:
    from services.cli.remote import api
    from shared import cordon
    from shared.control import operator
    from shared.settings import Settings
    from shared.store import Store

    settings = Settings()
    remote = api(settings)
    if remote is not None:
        async with remote:
            if args.action == "cordon":
                _show(await remote.cordon(args.node, args.reason), args.json)
                return 0
            if args.action == "uncordon":
                _show(await remote.uncordon(args.node), args.json)
                return 0
            return _drained(await remote.drain(args.node, args.timeout, args.reason), args.json)
    s = settings
    store = await Store.connect(s.database_url, 2, s.lease_margin_s, s.node_ttl_s)
    try:
        who = args.by or operator()
        if args.action == "cordon":
            _show(await cordon.cordon(store, args.node, who, args.reason), args.json)
            return 0
        if args.action == "uncordon":
            _show(await cordon.uncordon(store, args.node), args.json)
            return 0
        return _drained(
            await cordon.drain(store, args.node, who, args.timeout, args.reason), args.json
        )
    finally:
        await store.close()


def _drained(done: Drain, as_json: bool) -> int:
    if as_json:
        print_json(done.as_json())
    elif done.done:
        print(printable(f"{done.node.id} drained: cordoned, and nothing runs there"))
    else:
        ids = " ".join(str(i) for i in done.holding)
        print(printable(f"{done.node.id} not drained yet: still held by {ids}"), file=sys.stderr)
    return 0 if done.done else 1
