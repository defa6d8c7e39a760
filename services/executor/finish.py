"""Finishing attempts: outcomes in batches, in one transaction — Running -> Success | Failed |
TimedOut, then RetryWait while retries remain — and only then is each dispatch acknowledged.
An outcome whose task moved on is kept as a late result (and its lease given back); one that
Postgres still refuses fails its task alone, with the reason."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Container, Sequence
from typing import TypeVar
from uuid import UUID

from services.executor.backends import Key, Outcome
from services.executor.node import Attempt, Node, report_of
from services.executor.start import Received, Starter
from shared.errors import one_line
from shared.fsm import Move, State
from shared.jsonvalue import few
from shared.models import Task
from shared.outcome import Report, end_move, retries, storable
from shared.resilience import TRANSIENT, isolate, retrying
from shared.runtime import next_batch, wait_any
from shared.store.store import Tx
from shared.store.tasks import Moved

log = logging.getLogger(__name__)

Written = list[tuple[Attempt, Report]]
T = TypeVar("T")
FEW_VALUES = 5000  # values in a result made storable on the event loop (~10 ms); more: a thread


class Finisher:
    def __init__(self, node: Node, starter: Starter | None = None) -> None:
        self.node = node
        # held dispatches are claimed in the statement that writes the outcomes freeing their
        # slots (Starter.claimable); without a starter, its loop claims them after the write
        self.starter = starter
        self.readied: list[Task] = []  # launch failures written, for the ready queue

    async def run(self) -> None:
        linger = self.node.settings.finish_linger_s
        outcomes = self.node.outcomes
        while (batch := await next_batch(outcomes, linger=linger, settle=self._settle)) is not None:
            await self.finish(batch)
        # outcomes queued behind the end (an attempt claimed as the executor stopped, handed
        # back as a launch failure by the last batch's own claims): written too
        while rest := [o for o in _taken(outcomes) if o is not None]:
            await self.finish(rest)
        outcomes.put_nowait(None)

    async def _settle(self, linger: float) -> None:
        """After a first outcome, wait up to `linger` for more to join its batch — unless no
        attempt here is still running: then none can. Attempts started together (a node's
        slots refilled at once) end together, and the last of them ends the wait: the batch
        stays whole without holding every slot the full linger."""
        node = self.node
        if node.all_reported():
            return
        node.reported.clear()
        await wait_any(node.reported, node.stopping, timeout=linger)

    async def finish(self, batch: list[tuple[Attempt, Outcome]]) -> None:
        """Write a batch of outcomes; retried until Postgres takes it (an outcome is never
        dropped: the dispatch stays unacknowledged until it is written)."""
        node = self.node
        reports = await _storable(batch)
        # one task's older attempt beside its newer one: the older was superseded
        newest: dict[UUID, Attempt] = {}
        for attempt, _ in batch:
            kept = newest.get(attempt.task.id)
            if kept is None or attempt.task.attempt > kept.task.attempt:
                newest[attempt.task.id] = attempt
        current = [(a, reports[(a.task.id, a.task.attempt)]) for a in newest.values()]
        superseded = [
            (a, reports[(a.task.id, a.task.attempt)])
            for a, _ in batch
            if newest[a.task.id] is not a
        ]
        late: list[tuple[Task, Report]] = []
        claims = await self._claims(current, superseded)
        tries, sent_at = 0, time.monotonic()

        async def write() -> None:
            nonlocal claims, tries
            if claims:
                tries += 1
                try:
                    moved = await self._end_and_claim(current, claims)
                except TRANSIENT:
                    raise
                except Exception:
                    log.exception("outcomes and claims not written together; outcomes alone")
                    self._unclaimed(claims)
                    claims = []
                else:
                    try:
                        late[:] = await self._ended_and_claimed(
                            current, claims, moved, tries, sent_at
                        )
                        return
                    except TRANSIENT:
                        raise
                    except Exception:
                        # the outcomes are written (written again below, a CAS that finds them
                        # so); a claim not started is the heartbeat-monitor's to find Lost
                        log.exception("claims written with outcomes not all started")
                        self._claimed(claims)
                        claims = []
            late[:] = await self._write_isolating(current, superseded)

        # claims won are begun after the reply: a cancel meanwhile is kept (Node.claim_window)
        with node.claim_window() if claims else contextlib.nullcontext():
            done = await retrying("finish", write, node.stopping)
        if not done:
            self._unclaimed(claims)
            return  # shutting down with Postgres away: the heartbeat-monitor will find them
        self._claimed(claims)
        if self.readied:
            # attempts that never started are Ready again; the scheduler's reconcile pass
            # would find them too, but a push now saves it the wait
            readied, self.readied = self.readied, []
            with contextlib.suppress(*TRANSIENT):
                await node.queue.push(readied)
        for task, report in late:
            log.info(
                "outcome of %s attempt %d recorded, not applied (the task moved on): ok=%s",
                task.id,
                task.attempt,
                report.ok,
                extra={"task_id": str(task.id), "attempt": task.attempt},
            )
        for attempt, _ in batch:
            node.active.pop((attempt.task.id, attempt.task.attempt), None)
            node.unreported.pop((attempt.task.id, attempt.task.attempt), None)
        node.ended_here((a.task.id, a.task.attempt) for a, _ in batch)
        node.slot_freed.set()  # their ends are written: a held dispatch may take a slot
        # (their dispatches were acknowledged at their claim, Starter.settle: a no-op then)
        await node.acks.ack([attempt.message for attempt, _ in batch])

    async def _claims(self, current: Written, superseded: Written) -> list[Received]:
        """Held dispatches to claim with these outcomes: only beside successes alone (the
        common case, one statement without a transaction); failures and retries go their
        own way, and the starter's loop claims after them."""
        if self.starter is None or not _successes_alone(current, superseded):
            return []
        try:
            return await self.starter.claimable(len(current), (a.task.id for a, _ in current))
        except Exception as exc:
            # claims are an optimisation: the outcomes go alone, the starter's loop claims
            # (a dispatch to dead-letter with RabbitMQ away must not hold an outcome back)
            log.warning("no claims with these outcomes: %s", one_line(exc))
            return []

    def _claimed(self, claims: list[Received]) -> None:
        if claims and self.starter is not None:
            self.starter.claimed(claims)

    def _unclaimed(self, claims: list[Received]) -> None:
        if claims and self.starter is not None:
            self.starter.unclaimed(claims)

    async def _end_and_claim(self, current: Written, claims: list[Received]) -> Moved:
        """One statement: Running -> Success for these attempts, Scheduling -> Running for the
        held dispatches that take their slots. Returns the tasks that moved: the claimed ones
        as their rows, the ended ones by id alone."""
        assert self.starter is not None
        moves = self._end_moves(current, read_back=False) + self.starter.claim_moves(claims)
        return await self.node.store.tasks.transition_many(moves)

    async def _ended_and_claimed(
        self,
        current: Written,
        claims: list[Received],
        moved: Moved,
        tries: int,
        sent_at: float,
    ) -> list[tuple[Task, Report]]:
        """After `_end_and_claim`: ends that lost their CAS set aside as late results, the
        claims won started (`Starter.settle`). Returns the late ones."""
        assert self.starter is not None
        late = await self._set_aside_lost(current, moved.ids)
        rows = {t.id: t for t in moved}
        claimed = [rows[d.task_id] for d, _ in claims if d.task_id in rows]
        await self.starter.settle(claims, claimed, tries, sent_at)
        return late

    async def _write_isolating(
        self, current: Written, superseded: Written
    ) -> list[tuple[Task, Report]]:
        """Write the outcomes; the one outcome that cannot be written is replaced by a failure
        saying why: that task fails, the rest of the batch lands."""
        items = [(a, r, False) for a, r in current] + [(a, r, True) for a, r in superseded]

        async def write(some: Sequence[tuple[Attempt, Report, bool]]) -> list[tuple[Task, Report]]:
            now = [(a, r) for a, r, old in some if not old]
            return await self.write(now, [(a, r) for a, r, old in some if old])

        async def instead(
            item: tuple[Attempt, Report, bool], exc: Exception
        ) -> list[tuple[Task, Report]]:
            attempt, _, old = item
            log.exception("the outcome of %s cannot be written", attempt.task.id)
            why = Report(ok=False, error=f"outcome could not be stored: {one_line(exc)}")
            return await write([(attempt, storable(why), old)])

        return await isolate(items, write, instead)

    async def write(self, current: Written, superseded: Written) -> list[tuple[Task, Report]]:
        """The current attempts' ends (and retries), the late results of the rest, their
        leases given back; every report storable already (`storable`, as `finish` makes
        them). Returns the late ones.

        Successes alone (the common case) need no transaction beyond their one statement:
        nothing is retried, and a task whose end lost its CAS is set aside as late in a
        transaction of its own. Otherwise one transaction holds it all: a failure and its
        retry commit together."""
        node = self.node
        if _successes_alone(current, superseded):
            ends = self._end_moves(current, read_back=False)
            moved = await node.store.tasks.transition_many(ends)
            return await self._set_aside_lost(current, moved.ids)
        ends = self._end_moves(current)  # a failure's row plans its retry
        async with node.store.transaction() as tx:
            ended = await tx.tasks.transition_many(ends)
            await tx.tasks.transition_many(retries(ended))
            lost = [(a.task, r) for a, r in current if a.task.id not in ended.ids]
            late = await self._set_aside(tx, lost, [(a.task, r) for a, r in superseded])
        self.readied += [t for t in ended if t.status is State.READY]
        return late

    def _end_moves(self, current: Written, read_back: bool = True) -> list[Move]:
        """The attempts' ends; `read_back=False`: their rows are not read back (successes
        alone: nothing after the statement reads them)."""
        boot_id = self.node.boot_id
        # the reports are storable already: `finish` made them so to judge them
        return [
            end_move(a.task, r, f"ended on {a.task.node}", boot_id, read_back, stored=True)
            for a, r in current
        ]

    async def _set_aside_lost(
        self, current: Written, won: Container[UUID]
    ) -> list[tuple[Task, Report]]:
        """The ends among `current` that lost their CAS (not in `won`), set aside as late in a
        transaction of their own. Returns them."""
        lost = [(a.task, r) for a, r in current if a.task.id not in won]
        if not lost:
            return []
        async with self.node.store.transaction() as tx:
            return await self._set_aside(tx, lost, [])

    async def _set_aside(
        self, tx: Tx, lost: list[tuple[Task, Report]], superseded: list[tuple[Task, Report]]
    ) -> list[tuple[Task, Report]]:
        """Outcomes whose task moved on (canceled, paused, lost and retried): kept as late
        results, not applied, and their leases given back. Returns them."""
        node = self.node
        # a retry of a write whose COMMIT went through but whose reply was lost loses its CAS
        # to itself: that outcome is applied already, not late
        mine: set[UUID] = set()
        for where in {t.node for t, _ in lost}:
            of = [(t.id, t.version) for t, _ in lost if t.node == where]
            mine |= await tx.tasks.ended_with(of, f"ended on {where}")
        late = [(t, r) for t, r in lost if t.id not in mine] + superseded
        await tx.late.record(
            [
                (t.id, t.attempt, r.ok, r.result, r.error, f"attempt superseded on {t.node}")
                for t, r in late
            ]
        )
        # their processes are gone: a next attempt need not wait for their leases to lapse
        await tx.leases.release(node.boot_id, [(t.id, t.attempt) for t, _ in late])
        return late


def _successes_alone(current: Written, superseded: Written) -> bool:
    """Only current attempts' successes: their ends need no transaction beyond one statement
    (nothing is retried), and the claims of the slots they free may ride along."""
    return not superseded and all(r.ok for _, r in current)


async def storable_report(outcome: Outcome) -> Report:
    """An outcome's report made storable (`storable`); one whose result holds many values in a
    thread: the walk costs ~2 µs a value, and a megabyte of small numbers held the event loop
    (lease renewals, probe answers, for every attempt here) for over half a second."""
    report = report_of(outcome)
    if few(report.result, FEW_VALUES):
        return storable(report)
    return await asyncio.to_thread(storable, report)


async def _storable(batch: list[tuple[Attempt, Outcome]]) -> dict[Key, Report]:
    """The batch's reports made storable (`storable_report`), by attempt."""
    return {(a.task.id, a.task.attempt): await storable_report(o) for a, o in batch}


def _taken(queue: asyncio.Queue[T]) -> list[T]:
    """Whatever `queue` holds now, taken out."""
    items = []
    while not queue.empty():
        items.append(queue.get_nowait())
    return items
