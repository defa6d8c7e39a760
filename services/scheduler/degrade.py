"""Degrade: keep this scheduler's copy of the mode current, and — in whichever scheduler holds
the evaluator's lock for the moment — apply the automatic triggers and raise the alerts that
watch the cluster (nodes lost, backlogs).

The copy is re-read on NOTIFY sked_degrade, when the mode's end comes, and every
SKED_DEGRADE_CHECK_S; dispatch is woken whenever the mode in force changes. The evaluation is
one transaction under a transaction-scoped advisory lock taken without waiting: at most one
scheduler evaluates at a time, and each reads the row as the last one left it.
"""

from __future__ import annotations

import asyncio
import logging
import time

from services.scheduler.hub import Hub, Part
from shared import metrics, modes
from shared.alerts import Alert, Alerter
from shared.bus import AmqpBus
from shared.degrade import DegradeState, Rules, Snapshot, calm, decide
from shared.queues import ReadyQueue
from shared.runtime import wait_any
from shared.settings import Settings
from shared.store import Store

RESEND_S = 60.0  # what still fires is sent to Alertmanager again this often

log = logging.getLogger(__name__)

AUTOMATIC = "sked (automatic)"


def rules_of(s: Settings) -> Rules:
    return Rules(
        gpu_ratio=s.degrade_gpu_ratio,
        gpu_for_s=s.degrade_gpu_for_s,
        healthy_ratio=s.degrade_healthy_ratio,
        healthy_for_s=s.degrade_healthy_for_s,
        waiting=s.degrade_waiting,
        waiting_for_s=s.degrade_waiting_for_s,
        calm_s=s.degrade_calm_s,
    )


class Degrade(Part):
    def __init__(
        self,
        settings: Settings,
        store: Store,
        queue: ReadyQueue,
        hub: Hub,
        bus: AmqpBus | None,
        alerter: Alerter,
    ) -> None:
        super().__init__(settings, store, queue, hub)
        self.bus = bus
        self.alerter = alerter
        self.rules = rules_of(settings)
        # what this evaluator has alerted on and not yet resolved
        self.nodes_down: set[str] = set()
        self.backlogs: set[str] = set()
        self.firing: dict[tuple[str, str], Alert] = {}  # by name and node: sent again
        self._resend_at = 0.0  # monotonic

    async def run(self, stopping: asyncio.Event) -> None:
        hub, period = self.hub, self.settings.degrade_check_s
        next_check = time.monotonic()
        while not stopping.is_set():
            hub.degrade_changed.clear()
            await self.refresh()
            if time.monotonic() >= next_check:
                await self.evaluate()
                next_check = time.monotonic() + period
            wait = max(next_check - time.monotonic(), 0.0)
            left = hub.degrade.seconds_left()
            if left is not None and hub.degrade.mode().rank > 0:
                wait = min(wait, left + 0.01)  # the mode ends then: dispatch resumes on time
            await wait_any(hub.degrade_changed, stopping, timeout=wait)

    async def refresh(self) -> DegradeState:
        """Read the row; wake dispatch if the mode in force changed."""
        hub = self.hub
        before = hub.degrade.mode()
        read_at = time.monotonic()
        state = await self.store.degrade.read()
        hub.degrade.set(state, read_at)
        metrics.set_degrade_mode(hub.degrade.mode().value)
        if hub.degrade.mode() is not before:
            log.info("dispatching in %s mode (%s)", hub.degrade.mode().value, state.reason)
            hub.work_arrived()
        return state

    async def evaluate(self) -> None:
        """One evaluation, if this scheduler holds the evaluator's lock."""
        async with self.store.transaction() as tx:
            if not await tx.degrade.lead():
                return
            before = await tx.degrade.read()
            s = self.settings
            snapshot = await tx.degrade.snapshot(
                s.node_ttl_s, s.degrade_nodes_seen_s, self.nodes_down
            )
            change = decide(before, snapshot, self.rules)
            after = None
            if change is not None:
                after = await tx.degrade.set(
                    change.mode, change.reason, AUTOMATIC, change.for_s, before.version, True
                )
            elif (quiet := calm(before, snapshot, self.rules)) is not (before.calm_s is not None):
                # from when its cause was first seen gone (Postgres time, in the row: whichever
                # scheduler evaluates next counts from the same moment)
                await tx.degrade.mark_calm(quiet, before.version)
        if after is not None:
            # re-read by announce: an operator's change meanwhile is not contradicted
            after = await modes.announce(before, after, self.bus, self.alerter, self.store.degrade)
            self.hub.degrade_changed.set()
        raised = self.watch(snapshot)
        if time.monotonic() >= self._resend_at:
            # Alertmanager resolves an alert not heard of for its resolve_timeout (5 min by
            # default): what still fires — a mode set until lifted, a node still down, a
            # backlog still over — is sent again, by whichever scheduler evaluates
            self._resend_at = time.monotonic() + RESEND_S
            raised += self.still_firing(after or before, raised)
        await self.alerter.send(raised, snapshot.at or before.since)

    def still_firing(self, state: DegradeState, raised: list[Alert]) -> list[Alert]:
        """The alerts this evaluator raised that still fire, and the mode's (with resolves of
        the modes not in force), not sent now."""
        sent = {(a.name, a.labels.get("node", "")) for a in raised}
        again = [a for key, a in self.firing.items() if key not in sent]
        if not any(a.name == "SkedDegraded" for a in raised):
            again += modes.degraded_alerts(state)
        return again

    def watch(self, snapshot: Snapshot) -> list[Alert]:
        """Nodes that turned unhealthy (or came back), and backlogs past their bounds."""
        out = []
        down = set(snapshot.unhealthy)
        for node in sorted(down - self.nodes_down):
            out.append(
                Alert(
                    "SkedNodeLost",
                    "warning",
                    f"node {node} is not healthy",
                    "no heartbeat within SKED_NODE_TTL_S, or marked not ready",
                    {"node": node},
                    starts_at=snapshot.at,
                )
            )
        # resolved only when it is healthy again or has left: one gone quiet past the seen
        # window drops out of `unhealthy`, and is lost all the same
        back, departed = set(snapshot.back) - down, set(snapshot.departed) - down
        for node in sorted((back | departed) & self.nodes_down):
            how = "is back" if node in back else "has left (stopped cleanly, or forgotten)"
            out.append(
                Alert(
                    "SkedNodeLost",
                    "warning",
                    f"node {node} {how}",
                    "",
                    {"node": node},
                    resolved=True,
                )
            )
        self.nodes_down = (self.nodes_down | down) - back - departed
        s = self.settings
        bounds = {
            "SkedOutboxBacklog": (
                snapshot.outbox_backlog,
                s.alert_outbox_backlog,
                "critical",
                "events waiting to be published",
            ),
            "SkedReadyBacklog": (
                snapshot.waiting,
                s.alert_ready_backlog,
                "warning",
                "tasks waiting in Ready",
            ),
        }
        for name, (value, bound, severity, what) in bounds.items():
            over = value > bound
            if over and name not in self.backlogs:
                self.backlogs.add(name)
                out.append(
                    Alert(name, severity, f"{value} {what} (bound {bound})", starts_at=snapshot.at)
                )
            elif not over and name in self.backlogs:
                self.backlogs.discard(name)
                out.append(
                    Alert(name, severity, f"{value} {what}: under {bound} again", resolved=True)
                )
        for alert in out:
            key = (alert.name, alert.labels.get("node", ""))
            if alert.resolved:
                self.firing.pop(key, None)
            else:
                self.firing[key] = alert
        return out
