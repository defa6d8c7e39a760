"""Degrade modes, the pure part: which trigger holds, what the evaluator decides, the alerts a
change raises, and the mode in force as a scheduler's copy sees it."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from services.scheduler.hub import DegradeView
from shared.degrade import DegradeState, Mode, Rules, Snapshot, decide, triggered
from shared.errors import InvalidSpec
from shared.modes import MAX_FOR_S, alerts, check_duration, degraded_alerts, describe, event

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
RULES = Rules()


def state(
    mode: Mode = Mode.NORMAL, automatic: bool = False, remaining_s: float | None = None
) -> DegradeState:
    until = None if remaining_s is None else T0 + timedelta(seconds=60)
    return DegradeState(mode, automatic, "why", "ann@host", T0, until, 3, remaining_s)


def snap(**kw: int) -> Snapshot:
    values = {
        "nodes_total": 4,
        "nodes_healthy": 4,
        "gpu_total": 8,
        "gpu_used": 0,
        "waiting": 0,
        "outbox_backlog": 0,
    }
    values.update(kw)
    return Snapshot(**values)  # type: ignore[arg-type]


def test_each_trigger_and_its_mode() -> None:
    assert triggered(snap(), RULES) is None
    gpu = triggered(snap(gpu_used=8), RULES)
    assert gpu is not None
    assert (gpu.mode, gpu.for_s) == (Mode.PARTIAL, 600)
    assert "8 of 8 GPUs" in gpu.reason
    assert triggered(snap(gpu_used=7), RULES) is None  # 87.5 % is not above 95 %
    sick = triggered(snap(nodes_healthy=1), RULES)
    assert sick is not None
    assert (sick.mode, sick.for_s) == (Mode.FULL, 1800)
    assert triggered(snap(nodes_healthy=2), RULES) is None  # half is not fewer than half
    busy = triggered(snap(waiting=10_001), RULES)
    assert busy is not None
    assert (busy.mode, busy.for_s) == (Mode.PARTIAL, 300)
    assert triggered(snap(waiting=10_000), RULES) is None
    # the strongest wins
    both = triggered(snap(nodes_healthy=1, waiting=20_000), RULES)
    assert both is not None
    assert both.mode is Mode.FULL
    # no nodes, no GPUs: nothing to judge
    assert triggered(snap(nodes_total=0, nodes_healthy=0, gpu_total=0), RULES) is None


def test_the_evaluator_enters_strengthens_and_ends_automatic_modes() -> None:
    entered = decide(state(), snap(waiting=20_000), RULES)
    assert entered is not None
    assert (entered.mode, entered.automatic) == (Mode.PARTIAL, True)
    # already partial (automatic) and still busy: nothing to do; getting worse: full
    assert decide(state(Mode.PARTIAL, True, 100), snap(waiting=20_000), RULES) is None
    worse = decide(state(Mode.PARTIAL, True, 100), snap(nodes_healthy=1), RULES)
    assert worse is not None
    assert worse.mode is Mode.FULL
    # past its until: the mode ends (an event), or starts again while the trigger holds
    ended = decide(state(Mode.PARTIAL, True, -1), snap(), RULES)
    assert ended is not None
    assert ended.mode is Mode.NORMAL
    again = decide(state(Mode.PARTIAL, True, -1), snap(gpu_used=8), RULES)
    assert again is not None
    assert again.mode is Mode.PARTIAL
    assert decide(state(), snap(), RULES) is None


def test_a_backlog_rests_after_a_mode_ends_so_that_it_drains() -> None:
    """A mode dispatches nothing below its threshold, so the backlog that set it off is still
    there when it ends: were the trigger to fire again at once, those tasks would never run.
    After any mode ends the backlog trigger rests for as long as its mode lasts; the others
    (GPUs, nodes) judge what dispatching does not change, and fire again at once."""
    busy = snap(waiting=20_000)
    for mode, automatic in ((Mode.PARTIAL, True), (Mode.FULL, False)):
        # its end seen before anyone wrote it: the evaluator writes normal, not partial again
        ended = decide(state(mode, automatic, -1), busy, RULES)
        assert ended is not None
        assert (ended.mode, ended.automatic) == (Mode.NORMAL, True)
        assert decide(state(mode, automatic, -(RULES.waiting_for_s - 1)), busy, RULES) == ended
        # a rest as long as the mode lasted is over: the backlog sets it off again
        late = decide(state(mode, automatic, -(RULES.waiting_for_s + 1)), busy, RULES)
        assert late is not None
        assert late.mode is Mode.PARTIAL
    # the end written (the row normal since then, by the evaluator or an operator's lift)
    for after_s in (0.0, RULES.waiting_for_s - 1):
        assert decide(LEFT, at(after_s, waiting=20_000), RULES) is None
    again = decide(LEFT, at(RULES.waiting_for_s + 1, waiting=20_000), RULES)
    assert again is not None
    assert again.mode is Mode.PARTIAL
    # the row as the migration left it (never degraded), or no clock to judge by: no rest
    assert decide(replace(LEFT, version=1), at(0.0, waiting=20_000), RULES) is not None
    assert decide(LEFT, busy, RULES) is not None
    # the other triggers do not rest
    gpu = decide(LEFT, at(0.0, waiting=20_000, gpu_used=8), RULES)
    assert gpu is not None
    assert "GPUs" in gpu.reason
    sick = decide(LEFT, at(0.0, nodes_healthy=1), RULES)
    assert sick is not None
    assert sick.mode is Mode.FULL


# normal again since T0: a mode ended then
LEFT = DegradeState(Mode.NORMAL, True, "partial mode ended at its until", "", T0, None, 4, None)


def at(seconds_after: float, **kw: int) -> Snapshot:
    """A snapshot read `seconds_after` T0 (Postgres's clock)."""
    return replace(snap(**kw), at=T0 + timedelta(seconds=seconds_after))


@pytest.mark.parametrize("manual", [Mode.PARTIAL, Mode.FULL])
def test_an_automatic_mode_never_replaces_an_active_manual_one(manual: Mode) -> None:
    for pressure in (snap(waiting=20_000), snap(nodes_healthy=1), snap(gpu_used=8)):
        assert decide(state(manual, False, 100), pressure, RULES) is None
        assert decide(state(manual, False, None), pressure, RULES) is None
    # once the manual mode has ended, the triggers apply again
    after = decide(state(manual, False, -1), snap(nodes_healthy=1), RULES)
    assert after is not None
    assert after.mode is Mode.FULL


def test_a_change_raises_and_resolves_its_alerts() -> None:
    normal, partial = state(), state(Mode.PARTIAL, True, 60)
    fired = alerts(normal, partial)
    assert [(a.name, a.resolved, dict(a.labels)) for a in fired] == [
        ("SkedDegraded", False, {"mode": "partial"})
    ]
    assert fired[0].ends_at == partial.until
    full = state(Mode.FULL, False, None)
    changed = alerts(partial, full)
    assert [(a.labels["mode"], a.resolved) for a in changed] == [("partial", True), ("full", False)]
    assert changed[1].severity == "critical"
    assert [(a.labels["mode"], a.resolved) for a in alerts(full, normal)] == [("full", True)]
    wire = changed[1].wire(T0)
    assert wire["labels"] == {
        "alertname": "SkedDegraded",
        "severity": "critical",
        "service": "sked",
        "mode": "full",
    }
    assert set(wire["annotations"]) == {"summary", "description"}
    assert "endsAt" not in wire  # until lifted
    assert changed[0].wire(T0)["endsAt"] == "2026-12-01T12:00:00Z"  # resolved now
    body = event(partial, full)
    assert (body["previous"], body["mode"], body["by"]) == ("partial", "full", "ann@host")
    assert describe(full)["effective"] == "full"


def test_a_schedulers_copy_ends_the_mode_on_its_own_monotonic_deadline() -> None:
    view = DegradeView()
    assert view.mode() is Mode.NORMAL
    view.set(state(Mode.FULL, False, 30), read_at=0.0)  # read long ago: 30 s are over
    assert view.mode() is Mode.NORMAL
    view.set(state(Mode.FULL, False, 3600), read_at=0.0 + 1e12)
    assert view.mode() is Mode.FULL
    view.set(state(Mode.PARTIAL, False, None), read_at=0.0)
    assert view.mode() is Mode.PARTIAL  # no end
    assert view.seconds_left() is None


@pytest.mark.parametrize("for_s", [0.0, -5.0, float("nan"), float("inf"), float("-inf"), 1e300])
def test_a_duration_postgres_cannot_add_is_refused(for_s: float) -> None:
    with pytest.raises(InvalidSpec, match="duration must be above 0"):
        check_duration(for_s)


@pytest.mark.parametrize("for_s", [None, 0.001, 60.0, MAX_FOR_S])
def test_a_positive_duration_or_none_passes(for_s: float | None) -> None:
    check_duration(for_s)


def test_an_automatic_mode_ends_or_weakens_once_its_cause_has_been_gone_a_while() -> None:
    def calm(mode: Mode, calm_s: float | None, automatic: bool = True) -> DegradeState:
        return replace(state(mode, automatic, 1000), calm_s=calm_s)

    # the cause holds: nothing, however long the row says it was calm before
    assert decide(calm(Mode.FULL, 600), snap(nodes_healthy=1), RULES) is None
    # gone, but not for degrade_calm_s yet: nothing
    assert decide(calm(Mode.FULL, None), snap(), RULES) is None
    assert decide(calm(Mode.FULL, 59), snap(), RULES) is None
    lifted = decide(calm(Mode.FULL, 60), snap(), RULES)
    assert lifted is not None
    assert (lifted.mode, lifted.for_s, lifted.automatic) == (Mode.NORMAL, None, True)
    assert lifted.reason == "full mode lifted: its cause gone for 60 s"
    # a weaker trigger still holds: full weakens to it, for its own time
    weaker = decide(calm(Mode.FULL, 60), snap(gpu_used=8), RULES)
    assert weaker is not None
    assert (weaker.mode, weaker.for_s) == (Mode.PARTIAL, 600)
    assert weaker.reason.endswith("8 of 8 GPUs allocated (over 95%)")
    # an operator's mode is never lifted for calm
    assert decide(calm(Mode.FULL, 600, automatic=False), snap(), RULES) is None


def test_an_operators_lift_holds_the_triggers_back() -> None:
    """An operator's `sked degrade off` once lasted one evaluation when a trigger still held
    (nodes gone for good count for an hour): now it holds the triggers back until its until,
    or for calm_s when it has none; an automatic normal holds nothing back."""
    sick = {"nodes_healthy": 1}
    lift = replace(LEFT, automatic=False, reason="lifted")
    assert decide(lift, at(0.0, **sick), RULES) is None
    assert decide(lift, at(RULES.calm_s - 1, **sick), RULES) is None
    again = decide(lift, at(RULES.calm_s + 1, **sick), RULES)
    assert again is not None
    assert again.mode is Mode.FULL
    held = replace(lift, until=T0 + timedelta(hours=1), remaining_s=3000.0)
    assert decide(held, at(600, **sick), RULES) is None
    over = decide(replace(held, remaining_s=-1.0), at(3601, **sick), RULES)
    assert over is not None
    assert over.mode is Mode.FULL
    assert decide(LEFT, at(0.0, **sick), RULES) is not None  # the evaluator's own normal


def test_a_mode_left_after_its_until_or_shortened_resolves_its_alert() -> None:
    """Alertmanager keeps the later of two endsAt for one alert: a mode shortened resolves
    its alert before firing it again, and one left after its until passed is resolved too
    (it may still fire from before the shortening)."""
    expired = state(Mode.PARTIAL, False, -1)
    assert [(a.labels["mode"], a.resolved) for a in alerts(expired, LEFT)] == [("partial", True)]
    hour = replace(state(Mode.PARTIAL, False, 3600), until=T0 + timedelta(hours=1))
    short = replace(state(Mode.PARTIAL, False, 2), until=T0 + timedelta(seconds=2))
    assert [a.resolved for a in alerts(hour, short)] == [True, False]
    assert [a.resolved for a in alerts(short, hour)] == [False]  # extended: fired again only
    resent = degraded_alerts(state(Mode.FULL, False, None))
    assert [(a.labels["mode"], a.resolved) for a in resent] == [("full", False), ("partial", True)]
