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
    """The `scheduler.degrade` event's body. `previous` is the mode that was set, even when
    its until had passed (the evaluator ending it then says which mode ended);
    `previous_in_force` what was obeyed just before."""
    return {
        "mode": after.mode.value,
        "previous": before.mode.value,
        "previous_in_force": before.effective().value,
        "automatic": after.automatic,
        "reason": after.reason,
        "by": after.set_by,
        "since": after.since.isoformat(),
        "until": after.until.isoformat() if after.until else None,
        "version": after.version,
    }


def alerts(before: DegradeState, after: DegradeState) -> list[Alert]:
    """Entering, changing or extending a mode fires SkedDegraded, ending at its until (sent
    again when its until, reason or setter changes: Alertmanager keeps the first endsAt
    otherwise, and resolved an extended mode at its old end); leaving it resolves the one
    that fired, with the same labels, severity included — even when it is left after its
    until passed, as the alert may still fire then (below). Shortening a mode resolves its
    alert first: of two endsAt for one alert, Alertmanager keeps the later."""
    out = []
    firing = degraded_alert(after)
    if before.mode is not Mode.NORMAL and (
        before.mode is not after.mode or (firing is not None and _shortened(before, after))
    ):
        out.append(_degraded(before.mode, after.reason, before.since, resolved=True))
    if firing is not None:
        out.append(firing)
    return out


def _shortened(before: DegradeState, after: DegradeState) -> bool:
    """Whether `after` (the same mode) ends before the end Alertmanager was given for it."""
    if before.until is None or before.effective() is Mode.NORMAL:
        return False
    return after.until is None or after.until < before.until


def degraded_alert(state: DegradeState) -> Alert | None:
    """The SkedDegraded alert the mode in force fires, as `alerts` sends it; None in normal
    mode. (The evaluator sends it again while the mode lasts.)"""
    mode = state.effective()
    if mode is Mode.NORMAL:
        return None
    how = "automatically" if state.automatic else f"by {state.set_by or 'an operator'}"
    return _degraded(mode, state.reason, state.since, ends_at=state.until, how=how)


def _degraded(
    mode: Mode,
    reason: str,
    since: datetime,
    *,
    resolved: bool = False,
    ends_at: datetime | None = None,
    how: str = "",
) -> Alert:
    """SkedDegraded for `mode`: firing and resolving build the same labels (a resolve whose
    severity differed matched no alert, and a lifted full mode's stayed firing)."""
    summary = f"left {mode.value} mode" if resolved else f"scheduler in {mode.value} mode ({how})"
    return Alert(
        "SkedDegraded",
        "warning" if mode is Mode.PARTIAL else "critical",
        summary,
        reason,
        {"mode": mode.value},
        starts_at=since,
        ends_at=ends_at,
        resolved=resolved,
    )


def degraded_alerts(state: DegradeState) -> list[Alert]:
    """What the evaluator sends again while a mode lasts (Alertmanager forgets an alert not
    heard of for its resolve_timeout): the mode in force's SkedDegraded, and a resolve for
    every other mode's, so that one fired late by a change announced after a newer one (a
    slow broker held it back) is corrected at the next resend."""
    firing = degraded_alert(state)
    out = [] if firing is None else [firing]
    for mode in (Mode.PARTIAL, Mode.FULL):
        if firing is None or mode is not state.effective():
            out.append(_degraded(mode, state.reason, state.since, resolved=True))
    return out


async def announce(
    before: DegradeState,
    after: DegradeState,
    bus: Publisher | None,
    alerter: Alerter,
    degrade: Degrade | None = None,
) -> DegradeState:
    """Raise the change's alerts and publish its event; failures are logged, never raised
    (the change itself is committed). With `degrade`, the row is read again first: if it
    changed since (another operator, the evaluator), that change's own alerts stand, and
    these are not sent. Returns the row as read again at the end (`after` without
    `degrade`): what the caller's alerts should follow from now on."""
    body = event(before, after)
    log.warning(
        "degrade mode %s -> %s (%s, by %s): %s",
        body["previous"],
        after.mode.value,
        "automatic" if after.automatic else "manual",
        after.set_by or "-",
        after.reason,
    )
    now = await _reread(degrade, after)
    if now.version == after.version:
        # before the event: a broker slow to confirm held the alerts back for seconds, and
        # a newer change's could reach Alertmanager first, to be contradicted by these
        await alerter.send(alerts(before, after), after.since)
    else:
        log.info("degrade alerts for version %d not sent: now at %d", after.version, now.version)
    if bus is not None:
        try:
            await bus.publish(EVENTS_EXCHANGE, [Outgoing(DEGRADE_KEY, json.dumps(body).encode())])
        except Exception as exc:
            log.error("degrade event not published: %s", one_line(exc))
        now = await _reread(degrade, now)  # the publish may have taken seconds
    return now


async def _reread(degrade: Degrade | None, known: DegradeState) -> DegradeState:
    if degrade is None:
        return known
    try:
        return await degrade.read()
    except Exception as exc:  # Postgres away: the alerts go out as the change made them
        log.error("degrade row not read again: %s", one_line(exc))
        return known


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
    await announce(before, after, bus, alerter, degrade)
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
