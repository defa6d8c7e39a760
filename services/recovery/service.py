"""Recovery's loops, each a pass every SKED_RECOVERY_PERIOD_S (with jitter), shared by
replicas through FOR UPDATE SKIP LOCKED:

lost       Lost -> RetryWait (backoff) while retries remain, else Failed. The heartbeat-monitor
           asked the backend before declaring the loss, so the attempt is known gone. Each
           loss raises the alert SkedTaskLost (shared/alerts.py).
stuck      Scheduling for longer than SKED_STUCK_SCHEDULING_S (dispatched, never started: the
           dispatch was lost, or its node died first) -> Ready, and back into the queue. A late
           start of the old dispatch loses its CAS, so the attempt can never run twice.
nodes      forget nodes gone SKED_NODE_FORGET_S or longer (7 days) that hold no attempt and are
           not cordoned: their rows are deleted, at most once a minute.

These three make one pass, at once again while it finds a full batch (a mass loss), else
on the period or when a task is declared Lost. The repairs run each in a loop of its own, so
that their backlog (an outbox of 600,000 events) holds back no retry of a Lost task:

queue      rebuild the Redis ready queue after a Redis loss; re-add Ready tasks it lost.
outbox     publish events no relay has sent (every relay dead, or stuck): batch after batch
           while they come back full.

And, with SKED_RETENTION_DAYS or SKED_AUDIT_RETENTION_DAYS set, a loop of its own (so that a
long purge delays no recovery, and a failed one stops none):

retention  delete tasks that ended longer ago than the retention, with their history: a task
           outside any workflow alone, a workflow whole once every task of it has (see
           shared/store/sql/retention.sql); and the API's audit rows older than theirs. In
           batches of a bounded number of tasks, back to back while each finds a full one,
           then every SKED_RETENTION_CHECK_S; each kind apart, so that one failing stops no
           other.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from functools import partial

from shared import hooks
from shared.alerts import Alert, Alerter
from shared.fsm import State
from shared.models import Task
from shared.outcome import retry_or_fail
from shared.queues import ReadyQueue, reconcile
from shared.relay import OutboxRelay
from shared.resilience import TRANSIENT, supervise
from shared.runtime import wait_any
from shared.service import Loop, Service
from shared.settings import Settings
from shared.store import TAKEN_CHANNEL, Handler, Store, parse_notify

log = logging.getLogger(__name__)

# A retention statement deletes at most this many tasks, outside workflows or of workflows
# (a workflow bigger than this goes in chunks of it): each statement short, its history rows
# (six a task) included, well inside any statement timeout.
PURGE_TASKS = 500
PURGE_ROWS = 5000  # audit rows and tombstones: small, with no history
FORGET_EVERY_S = 60.0  # how often recovery looks for nodes to forget (a monotonic duration)
# Lost tasks, and stuck ones, moved a pass; a pass that finds a full batch is followed by
# another at once.
RECOVER_BATCH = 100


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
        """Recovery proper and the two repairs, each a loop of its own, supervised apart: a
        repair's backlog or failure (RabbitMQ down) holds back no recovery of tasks."""
        parts = {"": self.recover, ": queue": self.repair_queue, ": outbox": self.repair_outbox}
        async with asyncio.TaskGroup() as group:
            for suffix, part in parts.items():
                group.create_task(supervise(self.name + suffix, part, self.stopping))

    def _period(self) -> float:
        return self.settings.recovery_period_s * random.uniform(0.8, 1.2)

    async def recover(self) -> None:
        """Lost and stuck tasks, and nodes to forget: a pass every period, at once when a
        task is declared Lost (NOTIFY), and at once again while a pass finds a full batch:
        a node pool's thousand lost attempts went at 100 a period."""
        while not self.stopping.is_set():
            self.wake.clear()
            done = await self.run_once()
            if max(done["lost"], done["stuck"]) >= RECOVER_BATCH:
                continue  # more are waiting
            await wait_any(self.wake, self.stopping, timeout=self._period())

    async def repair_queue(self) -> None:
        """Rebuild the ready queue, or re-add the Ready tasks it lost, every period."""
        while not self.stopping.is_set():
            await reconcile(self.queue, self.store.tasks, self.settings.reconcile_s)
            await wait_any(self.stopping, timeout=self._period())

    async def repair_outbox(self) -> None:
        """Publish what no relay has: batch after batch while they come back full (as a
        relay drains), then every period. Stops between batches when told to."""
        while not self.stopping.is_set():
            if await self.relay.run_once() >= self.relay.batch:
                continue
            await wait_any(self.stopping, timeout=self._period())

    def _on_notify(self, _c: object, _p: int, _ch: str, payload: str) -> None:
        # a task declared Lost is retried at once, not at the next period
        if State.LOST.value in parse_notify(payload).states:
            self.wake.set()

    async def run_once(self) -> dict[str, int]:
        """One pass of recovery proper (not the repairs): how many tasks and nodes it moved."""
        done = {
            "lost": len(await self.recover_lost()),
            "stuck": len(await self.requeue_stuck()),
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
        """One batch of each kind past its retention deleted, each kind apart: one that fails
        (a statement timeout on a big workflow, say) is logged and stops none after it, and
        the first transient error is raised once every kind was tried. Returns the tasks
        deleted and whether a batch came back full (more may be waiting)."""
        deleted, more = 0, False
        failure: BaseException | None = None
        for kind, step in self._purges():
            try:
                tasks, full = await step()
            except TRANSIENT as exc:
                log.warning("retention: purging %s failed: %s", kind, exc)
                failure = failure or exc
                continue
            except Exception:
                log.exception("retention: purging %s failed; trying again at the next look", kind)
                continue
            deleted += tasks
            more = more or full
        if deleted:
            hooks.purged(deleted)
        if failure is not None:
            raise failure
        return deleted, more

    def _purges(self) -> list[tuple[str, Callable[[], Awaitable[tuple[int, bool]]]]]:
        """The kinds to purge, each a step returning (tasks deleted, whether more may wait)."""
        steps: list[tuple[str, Callable[[], Awaitable[tuple[int, bool]]]]] = []
        if (days := self.settings.retention_days) > 0:
            older_than_s = days * 86_400
            steps += [
                ("tasks", partial(self._purge_tasks, older_than_s)),
                ("workflows", partial(self._purge_workflows, older_than_s)),
                # a deleted id's tombstone (a read or wait for it says it was deleted) is kept
                # one retention more
                ("tombstones", partial(self._purge_tombstones, older_than_s)),
            ]
        if (days := self.settings.audit_retention_days) > 0:
            steps.append(("API audit rows", partial(self._purge_audit, days * 86_400)))
        return steps

    async def _purge_tasks(self, older_than_s: float) -> tuple[int, bool]:
        alone = await self.store.retention.purge_tasks(PURGE_TASKS, older_than_s)
        if alone:
            log.info("retention: deleted %d finished tasks", len(alone))
        return len(alone), len(alone) == PURGE_TASKS

    async def _purge_workflows(self, older_than_s: float) -> tuple[int, bool]:
        whole = await self.store.retention.purge_workflows(PURGE_TASKS, older_than_s)
        if whole.workflows:
            log.info(
                "retention: deleted %d finished workflows whole (%d tasks)",
                whole.workflows,
                whole.tasks,
            )
        return whole.tasks, whole.more

    async def _purge_tombstones(self, older_than_s: float) -> tuple[int, bool]:
        gone = await self.store.retention.purge_tombstones(PURGE_ROWS, older_than_s)
        return 0, gone == PURGE_ROWS

    async def _purge_audit(self, older_than_s: float) -> tuple[int, bool]:
        gone = await self.store.retention.purge_audit(PURGE_ROWS, older_than_s)
        if gone:
            log.info("retention: deleted %d API audit rows", gone)
        return 0, gone == PURGE_ROWS

    async def recover_lost(self) -> list[Task]:
        moved = await self.store.claims.recover_lost(
            RECOVER_BATCH, lambda t: retry_or_fail(t, "lost")
        )
        if moved:
            await self.alerter.send([lost_alert(t) for t in moved], moved[0].updated_at)
        return moved

    async def teardown(self) -> None:
        await self.alerter.close()

    async def requeue_stuck(self) -> list[Task]:
        stuck = await self.store.claims.requeue_stuck_scheduling(
            RECOVER_BATCH, self.settings.stuck_scheduling_s
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
