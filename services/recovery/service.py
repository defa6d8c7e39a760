"""Recovery's loops, each a pass every SKED_RECOVERY_PERIOD_S (with jitter), shared by
replicas through FOR UPDATE SKIP LOCKED:

lost       Lost -> RetryWait (backoff) while retries remain, else Failed. The heartbeat-monitor
           asked the backend before declaring the loss, so the attempt is known gone. Each
           loss raises the alert SkedTaskLost (shared/alerts.py).
stuck      Scheduling for longer than SKED_STUCK_SCHEDULING_S (dispatched, never started: the
           dispatch was lost, or its node died first) -> Ready, and back into the queue. A late
           start of the old dispatch loses its CAS, so the attempt can never run twice.
queue      rebuild the Redis ready queue after a Redis loss; re-add Ready tasks it lost.
outbox     publish events no relay has sent (every relay dead, or stuck).
nodes      forget nodes gone SKED_NODE_FORGET_S or longer (7 days) that hold no attempt and are
           not cordoned: their rows are deleted, at most once a minute.

And, with SKED_RETENTION_DAYS or SKED_AUDIT_RETENTION_DAYS set, a loop of its own (so that a
long purge delays no recovery, and a failed one stops none):

retention  delete tasks that ended longer ago than the retention, with their history: a task
           outside any workflow alone, a workflow whole once every task of it has (see
           shared/store/sql/retention.sql); and the API's audit rows older than theirs. In
           batches, back to back while each finds a full one, then every
           SKED_RETENTION_CHECK_S.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Sequence

from shared import hooks
from shared.alerts import Alert, Alerter
from shared.fsm import State
from shared.models import Task
from shared.outcome import retry_or_fail
from shared.queues import ReadyQueue, reconcile
from shared.relay import OutboxRelay
from shared.resilience import TRANSIENT
from shared.runtime import wait_any
from shared.service import Loop, Service
from shared.settings import Settings
from shared.store import TAKEN_CHANNEL, Handler, Store, parse_notify

log = logging.getLogger(__name__)

# A retention statement deletes at most this many tasks outside workflows, or workflows: each
# a short transaction holding few locks, its history rows (six a task) included.
PURGE_TASKS = 500
PURGE_WORKFLOWS = 20
PURGE_ROWS = 5000  # audit rows and tombstones: small, with no history
FORGET_EVERY_S = 60.0  # how often recovery looks for nodes to forget (a monotonic duration)


class Recovery(Service):
    name = "recovery"

    def __init__(
        self,
        settings: Settings,
        store: Store,
        queue: ReadyQueue,
        relay: OutboxRelay,
        alerter: Alerter | None = None,
    ) -> None:
        super().__init__(settings, store)
        self.queue = queue
        self.relay = relay
        self.alerter = alerter or Alerter(None, None)
        self._forget_at = 0.0  # monotonic: when to look for nodes to forget next

    def loops(self) -> Sequence[Loop]:
        loops: list[Loop] = [(self.name, self.loop)]
        if self.settings.retention_days > 0 or self.settings.audit_retention_days > 0:
            loops.append(("retention", self.retain))
        return loops

    def channels(self) -> Sequence[tuple[str, Handler]]:
        return [(TAKEN_CHANNEL, self._on_notify)]

    def announce(self) -> str:
        line = f"recovery running every {self.settings.recovery_period_s:g} s"
        if (days := self.settings.retention_days) > 0:
            line += f"; tasks kept {days:g} days after they end"
        if (days := self.settings.audit_retention_days) > 0:
            line += f"; API audit kept {days:g} days"
        return line

    async def loop(self) -> None:
        while not self.stopping.is_set():
            self.wake.clear()
            await self.run_once()
            period = self.settings.recovery_period_s * random.uniform(0.8, 1.2)
            await wait_any(self.wake, self.stopping, timeout=period)

    def _on_notify(self, _c: object, _p: int, _ch: str, payload: str) -> None:
        # a task declared Lost is retried at once, not at the next period
        if State.LOST.value in parse_notify(payload).states:
            self.wake.set()

    async def run_once(self) -> dict[str, int]:
        done = {
            "lost": len(await self.recover_lost()),
            "stuck": len(await self.requeue_stuck()),
            "queue": await reconcile(self.queue, self.store.tasks, self.settings.reconcile_s),
            "outbox": await self.relay.drain(),
            "nodes": len(await self.forget_nodes()),
        }
        if done["lost"] or done["stuck"]:
            log.warning("recovered: %s", done)
        return done

    async def forget_nodes(self) -> list[str]:
        """Delete the rows of nodes gone SKED_NODE_FORGET_S or longer (holding no attempt, not
        cordoned), when a minute has passed since the last look. Returns their ids."""
        gone_for_s = self.settings.node_forget_s
        if gone_for_s <= 0 or time.monotonic() < self._forget_at:
            return []
        self._forget_at = time.monotonic() + FORGET_EVERY_S
        forgotten = await self.store.nodes.forget(gone_for_s)
        if forgotten:
            log.info(
                "forgot %d nodes gone %g s or longer: %s", len(forgotten), gone_for_s, forgotten
            )
        return forgotten

    async def retain(self) -> None:
        """The retention loop: purge while batches come back full, then wait for the next look.
        Between full batches it rests as long as the last took, so that catching up on a long
        history (retention just turned on) holds at most half of one Postgres backend, not the
        database the tasks run on. A statement that fails is logged and tried at the next look:
        retention is housekeeping, and must never stop the recovery of tasks."""
        while not self.stopping.is_set():
            began = time.monotonic()
            try:
                _, more = await self.purge()
            except TRANSIENT:
                raise  # supervise() backs off and restarts the loop
            except Exception:
                log.exception("retention: purge failed; trying again at the next look")
                more = False
            if more:
                rest = time.monotonic() - began
            else:
                rest = self.settings.retention_check_s * random.uniform(0.8, 1.2)
            await wait_any(self.stopping, timeout=rest)

    async def purge(self) -> tuple[int, bool]:
        """One batch of each kind past its retention deleted. Returns the tasks deleted and
        whether a batch came back full (more may be waiting)."""
        deleted, more = 0, False
        retention = self.store.retention
        if (days := self.settings.retention_days) > 0:
            alone = await retention.purge_tasks(PURGE_TASKS, days * 86_400)
            whole = await retention.purge_workflows(PURGE_WORKFLOWS, days * 86_400)
            deleted = len(alone) + whole.tasks
            # a deleted id's tombstone (a read or wait for it says it was deleted) is kept
            # one retention more
            gone = await retention.purge_tombstones(PURGE_ROWS, days * 86_400)
            more = len(alone) == PURGE_TASKS or whole.workflows == PURGE_WORKFLOWS
            more = more or gone == PURGE_ROWS
            if deleted:
                hooks.purged(deleted)
                log.info(
                    "retention: deleted %d finished tasks (%d workflows whole)",
                    deleted,
                    whole.workflows,
                )
        if (days := self.settings.audit_retention_days) > 0:
            audited = await retention.purge_audit(PURGE_ROWS, days * 86_400)
            more = more or audited == PURGE_ROWS
            if audited:
                log.info("retention: deleted %d API audit rows", audited)
        return deleted, more

    async def recover_lost(self) -> list[Task]:
        moved = await self.store.claims.recover_lost(100, lambda t: retry_or_fail(t, "lost"))
        if moved:
            await self.alerter.send([lost_alert(t) for t in moved], moved[0].updated_at)
        return moved

    async def teardown(self) -> None:
        await self.alerter.close()

    async def requeue_stuck(self) -> list[Task]:
        stuck = await self.store.claims.requeue_stuck_scheduling(
            100, self.settings.stuck_scheduling_s
        )
        await self.queue.push(stuck)
        return stuck


def lost_alert(task: Task) -> Alert:
    """SkedTaskLost for a task recovery just moved on from Lost (to RetryWait or Failed)."""
    then = "retried" if task.status is State.RETRY_WAIT else "failed"
    return Alert(
        "SkedTaskLost",
        "warning",
        f"task {task.name} ({task.id}) attempt {task.attempt} lost on {task.node}; {then}",
        task.status_reason,
        {"task_id": str(task.id), "node": task.node or "", "attempt": str(task.attempt)},
        starts_at=task.updated_at,
    )
