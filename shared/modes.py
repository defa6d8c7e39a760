"""Changing the degrade mode: the CAS on its row, then its event on `sked.events` (routing key
`scheduler.degrade`) and its alert. One path for the operator's `sked degrade`, the operator
API and the scheduler's automatic evaluator."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from datetime import datetime
from typing import Any

from shared.alerts import Alert, Alerter, Publisher
from shared.bus import EVENTS_EXCHANGE, Outgoing
from shared.degrade import DegradeState, Mode
from shared.errors import InvalidSpec, SkedError, one_line
from shared.jsonvalue import note
from shared.store.degrade import Degrade

log = logging.getLogger(__name__)

DEGRADE_KEY = "scheduler.degrade"
MAX_FOR_S = 1e9  # ~31 years: far inside a Postgres interval, and longer than any spell


class ModeChanged(SkedError):
    """The mode changed meanwhile (another operator or the evaluator): read it and retry."""


def event(before: DegradeState, after: DegradeState) -> dict[str, Any]:
    """The `scheduler.degrade` event's body."""
    return {
        "mode": after.mode.value,
        "previous": before.effective().value,
        "automatic": after.automatic,
        "reason": after.reason,
        "by": after.set_by,
        "since": after.since.isoformat(),
        "until": after.until.isoformat() if after.until else None,
        "version": after.version,
    }


def alerts(before: DegradeState, after: DegradeState) -> list[Alert]:
    """Entering (or changing) a mode fires SkedDegraded, ending at its until; leaving it
    resolves the one that fired (same labels)."""
    out = []
    previous = before.effective()
    if previous is not Mode.NORMAL and previous is not after.mode:
        out.append(
            Alert(
                "SkedDegraded",
                "warning",
                f"left {previous.value} mode",
                after.reason,
                {"mode": previous.value},
                starts_at=before.since,
                resolved=True,
            )
        )
    if after.mode is not Mode.NORMAL and after.mode is not previous:
        how = "automatically" if after.automatic else f"by {after.set_by or 'an operator'}"
        out.append(
            Alert(
                "SkedDegraded",
                "warning" if after.mode is Mode.PARTIAL else "critical",
                f"scheduler in {after.mode.value} mode ({how})",
                after.reason,
                {"mode": after.mode.value},
                starts_at=after.since,
                ends_at=after.until,
            )
        )
    return out


async def announce(
    before: DegradeState, after: DegradeState, bus: Publisher | None, alerter: Alerter
) -> None:
    """Publish the change and raise its alerts; failures are logged, never raised (the
    change itself is committed)."""
    body = event(before, after)
    log.warning(
        "degrade mode %s -> %s (%s, by %s): %s",
        body["previous"],
        after.mode.value,
        "automatic" if after.automatic else "manual",
        after.set_by or "-",
        after.reason,
    )
    if bus is not None:
        try:
            await bus.publish(EVENTS_EXCHANGE, [Outgoing(DEGRADE_KEY, json.dumps(body).encode())])
        except Exception as exc:
            log.error("degrade event not published: %s", one_line(exc))
    await alerter.send(alerts(before, after), after.since)


def check_duration(for_s: float | None) -> None:
    """Raises InvalidSpec unless `for_s` is None (until lifted) or a positive number of seconds
    Postgres can add to a time (NaN, infinities and negatives are not)."""
    if for_s is not None and not 0 < for_s <= MAX_FOR_S:  # NaN fails it too
        raise InvalidSpec(
            f"a degrade mode's duration must be above 0 and at most {MAX_FOR_S:.0e} s, not {for_s}"
        )


async def change(
    degrade: Degrade,
    mode: Mode,
    reason: str,
    by: str,
    for_s: float | None,
    bus: Publisher | None,
    alerter: Alerter,
    automatic: bool = False,
) -> tuple[DegradeState, DegradeState]:
    """Set the mode (CAS against the row as just read); announce it. Returns (before, after).
    Raises ModeChanged if it changed between the read and the write, InvalidSpec for a
    duration that is not a positive number of seconds Postgres can hold."""
    check_duration(for_s)
    reason, by = note("reason", reason), note("by", by)
    before = await degrade.read()
    after = await degrade.set(mode, reason, by, for_s, before.version, automatic)
    if after is None:
        raise ModeChanged("the degrade mode changed meanwhile; look again and retry")
    await announce(before, after, bus, alerter)
    return before, after


def describe(state: DegradeState) -> dict[str, Any]:
    """The mode as `sked degrade status --json` and the API show it."""
    out = asdict(state)
    out["mode"] = state.mode.value
    out["effective"] = state.effective().value
    for key in ("since", "until"):
        value = out[key]
        out[key] = value.isoformat() if isinstance(value, datetime) else value
    return out
