"""`sked degrade`: set, lift and show the degrade mode every scheduler obeys.

sked degrade partial|full --for SECONDS --reason TEXT [--by WHO]
sked degrade off [--for SECONDS] [--reason TEXT] [--by WHO]
                 the automatic triggers are held back for SECONDS (default:
                 SKED_DEGRADE_CALM_S); then a trigger that still holds degrades again
sked degrade status [--json]
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from services.cli.output import print_json, run
from shared.errors import SkedError
from shared.redact import printable

if TYPE_CHECKING:  # loaded when the command runs: building the parser stays cheap
    from shared.degrade import DegradeState


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "degrade", help="degrade modes: dispatch only urgent tasks (partial) or none (full)"
    )
    p.add_argument("mode", choices=["partial", "full", "off", "status"])
    p.add_argument(
        "--for",
        dest="for_s",
        type=float,
        metavar="SECONDS",
        help="how long (default: until off); off: how long the automatic triggers are held "
        "back (default: SKED_DEGRADE_CALM_S)",
    )
    p.add_argument("--reason", default="", help="why (required for partial and full)")
    p.add_argument("--by", help="who is acting (default: user@host)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=lambda a: run(_degrade(a)))


def _line(state: DegradeState) -> str:
    from shared.degrade import Mode

    mode = state.effective()
    if mode is Mode.NORMAL:
        if not state.automatic and state.until is not None and (state.remaining_s or 0) > 0:
            held = f"set by {state.set_by or '-'}: automatic triggers held back until "
            return printable(f"normal: everything is dispatched ({held}{state.until.isoformat()})")
        return "normal: everything is dispatched"
    how = "automatic" if state.automatic else f"set by {state.set_by or '-'}"
    until = f" until {state.until.isoformat()}" if state.until else " until lifted"
    line = f"{mode.value} since {state.since.isoformat()}{until} ({how}): {state.reason}"
    return printable(line)  # who and why come from an operator's free text


async def _degrade(args: argparse.Namespace) -> int:
    from shared.client import SkedClient
    from shared.control import operator
    from shared.degrade import Mode
    from shared.modes import describe

    async with SkedClient() as client:
        if args.mode == "status":
            state = await client.degrade_status()
        else:
            mode = Mode.NORMAL if args.mode == "off" else Mode(args.mode)
            if mode is not Mode.NORMAL and not args.reason:
                raise SkedError("degrade: --reason is required for partial and full")
            reason = args.reason or ("lifted" if mode is Mode.NORMAL else "")
            state = await client.degrade(mode, reason, args.by or operator(), args.for_s)
    if args.json:
        print_json(describe(state))
    else:
        print(_line(state))
    return 0
