"""Starting attempts: dispatches from this node's queue, in batches. Each is claimed with one
CAS Scheduling -> Running (which takes the attempt's lease) before any process starts: a
redelivered or duplicated dispatch then loses its CAS and starts nothing, so an attempt is
never started twice."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import replace
from uuid import UUID

from aio_pika.abc import AbstractIncomingMessage

from services.executor.backends import Key, Outcome
from services.executor.node import Attempt, Item, Node, items_of
from shared import fsm, hooks
from shared.backlog import hold_again, remove, take
from shared.errors import one_line
from shared.fsm import State
from shared.models import Dispatch, Task
from shared.resilience import isolate, retrying
from shared.runtime import next_batch, wait_any

log = logging.getLogger(__name__)

Received = tuple[Dispatch, Item]


class Starter:
    def __init__(self, node: Node) -> None:
        self.node = node
        self.held: deque[Item] = deque()  # the backlog, when gated
        # dispatches whose claim statement is in flight (the finisher's too): they hold slots
        self.claiming = 0
        # set while the start loop is not running: no claim of its is in flight (the drain
        # waits for it, so that every attempt it won is in node.active)
        self.quiet = asyncio.Event()
        self.quiet.set()

    def free_slots(self, freeing: int = 0) -> int:
        """Slots no attempt holds or is being claimed for, once `freeing` outcomes are written."""
        node = self.node
        return node.settings.slots - node.running + freeing - self.claiming

    async def run(self) -> None:
        self.quiet.clear()
        try:
            if self.node.gated:
                await self._run_gated()
            else:
                while (batch := await next_batch(self.node.inbox)) is not None:
                    await self.start_items([item for items in batch for item in items])
            await self._hand_back_unstarted()
        finally:
            self.quiet.set()

    async def _run_gated(self) -> None:
        """With a backlog: dispatches beyond the free slots are held (their tasks stay
        Scheduling) and claimed the moment an attempt's outcome frees a slot — a claim
        statement away, not a round through the scheduler and RabbitMQ."""
        node, held = self.node, self.held
        while not node.stopping.is_set():
            if not held:
                batch = await next_batch(node.inbox)
                if batch is None:
                    return
                held.extend(item for items in batch for item in items)
            if not self.gather():
                return
            if not held:
                continue  # woken by an empty batch: a claim took what came (gather)
            free = self.free_slots()
            if free <= 0:
                node.slot_freed.clear()
                hold_s = node.backlog.hold_s
                if hold_s is None:  # a fixed backlog: held until a slot frees
                    await wait_any(node.slot_freed, node.stopping)
                    continue
                wait_s = held[0].received_at + hold_s - time.monotonic()
                if wait_s > 0 and await wait_any(node.slot_freed, node.stopping, timeout=wait_s):
                    continue
                await self._hand_back_held(hold_s)
                continue
            await self.start_items(self.take_held(free))

    def gather(self) -> bool:
        """Every dispatch waiting in the inbox moved to the backlog; False at its end (None,
        left for the loop). Into an empty backlog, an empty batch wakes a loop on the inbox."""
        inbox, empty = self.node.inbox, not self.held
        while not inbox.empty():
            items = inbox.get_nowait()
            if items is None:
                inbox.put_nowait(None)
                return False
            self.held.extend(items)
        if empty and self.held:
            inbox.put_nowait([])
        return True

    async def drop_moved_on(self, among: set[UUID] | None = None) -> int:
        """Held dispatches whose attempt is no longer Scheduling on its node, dropped and
        acknowledged: their task moved on without this node (canceled, paused, failed by the
        schedule-timeout sweep, back to Ready by recovery, claimed from another copy). Each
        held a place in the backlog and, once a slot freed, a claim to lose ahead of the live
        ones, while placement (counting from Postgres) sent more into its room. One read of
        the held tasks, each node heartbeat, and when a task held here (`among`) is taken away."""
        if not self.node.gated:
            return 0  # nothing is held: the inbox is the start loop's
        self.gather()
        judged = [(item, d) for item in self.held if (d := item.dispatch) is not None]
        if not judged or (among is not None and not among & {d.task_id for _, d in judged}):
            return 0
        found = await self.node.store.tasks.get_many(list({d.task_id for _, d in judged}))
        live = {(t.id, t.attempt, t.node) for t in found if t.status is State.SCHEDULING}
        dead = [item for item, d in judged if (d.task_id, d.attempt, d.node) not in live]
        gone = remove(self.held, dead)  # not those a claim took meanwhile: they are its own
        if gone:
            log.info("%d held dispatches dropped: their tasks moved on", len(gone))
            await self.node.acks.ack(gone)
        return len(gone)

    def take_held(self, n: int) -> list[Item]:
        """The `n` held dispatches to start next, in the ready line's order (backlog.take)."""
        return take(self.held, n)

    def _hold_again(self, items: list[Item]) -> None:
        hold_again(self.held, items)  # in place: the gated loop holds the deque

    async def _hand_back_held(self, hold_s: float) -> None:
        """Dispatches held `hold_s` or longer go back to Ready, in their place in line, for a
        node with a free slot: the slots here are all taken by attempts longer than a backlog
        suits, so this node holds none from now until its attempts run short."""
        node, held = self.node, self.held
        before = time.monotonic() - hold_s
        late: list[Item] = []
        while held and held[0].received_at <= before:
            late.append(held.popleft())
        if not late:
            return
        log.info("%d held dispatches waited %gs for a slot; handed back", len(late), hold_s)
        if node.backlog.handed_back():
            node.backlog_changed.set()
        await self.node.hand_back(late, f"held on node {node.id} {hold_s:g}s without a free slot")

    async def start(self, batch: list[AbstractIncomingMessage]) -> int:
        """Claim and start a batch of messages' dispatches; how many attempts started here."""
        return await self.start_items([item for m in batch for item in items_of(m)])

    async def start_items(self, items: list[Item]) -> int:
        """Claim and start these dispatches; returns how many attempts started here."""
        return await self._claim_isolating(await self._checked(items))

    async def _checked(self, items: list[Item]) -> list[Received]:
        """The dispatches among `items` to claim: one per task, for this node, not running
        here already. The rest are dead-lettered (unreadable, another node's) or settled."""
        node = self.node
        fresh: dict[UUID, Received] = {}
        for item in items:
            dispatch = item.dispatch
            if dispatch is None:  # only a bug or a foreign publisher does this
                await node.dead_letter(item, item.entry.problem or "unreadable dispatch")
                continue
            if dispatch.node not in node.serves:
                await node.dead_letter(item, f"a dispatch for node {dispatch.node!r}")
                continue
            key = (dispatch.task_id, dispatch.attempt)
            if key in node.active:
                # the same attempt again while it runs: redelivered after a reconnect, the
                # dispatch message behind the notification it was started from, a duplicate
                await node.acks.ack([item])
                continue
            if key in node.ended:
                # it ran here and its outcome is written: nothing to claim
                await node.acks.ack([item])
                continue
            older = fresh.get(dispatch.task_id)
            if older is not None:
                # the same task twice in one batch: the higher attempt is the live one (the
                # older was superseded), and a copy of the same attempt is a duplicate
                stale, keep = sorted([older, (dispatch, item)], key=lambda d: d[0].attempt)
                await node.acks.ack([stale[1]])
                fresh[dispatch.task_id] = keep
                continue
            fresh[dispatch.task_id] = (dispatch, item)
        return list(fresh.values())

    async def claimable(self, freeing: int, ending: Iterable[UUID]) -> list[Received]:
        """Held dispatches for the slots that `freeing` outcomes about to be written free (and
        any free now), to be claimed in the statement that writes those outcomes: a slot
        changes hands in one commit, not two round trips apart. A dispatch for a task among
        `ending` stays held (one statement moves a task once). Until `settle` or `unclaimed`
        they count as being claimed (`claimed` or `unclaimed` counts them off)."""
        node = self.node
        if not node.gated or node.stopping.is_set():
            return []
        self.gather()  # dispatches that came while the loop waited for a slot count too
        take = min(self.free_slots(freeing), len(self.held))
        if take <= 0:
            return []
        items = self.take_held(take)
        ending = set(ending)
        clash = [i for i in items if i.dispatch is not None and i.dispatch.task_id in ending]
        self._hold_again(clash)
        items = [i for i in items if i not in clash]
        self.claiming += len(items)  # counted before the checks' awaits: the slots are taken
        try:
            claims = await self._checked(items)
        except BaseException:
            # (a dead letter that cannot go out): those not settled go back, none is claimed
            self.claiming -= len(items)
            self._hold_again([i for i in items if not i.settled])
            raise
        self.claiming -= len(items) - len(claims)
        return claims

    def claimed(self, claims: Sequence[Received]) -> None:
        """Claims from `claimable` that were written and settled."""
        self.claiming -= len(claims)

    def unclaimed(self, claims: Sequence[Received]) -> None:
        """Claims that were not written go back to the front of the backlog."""
        self.claiming -= len(claims)
        self._hold_again([item for _, item in claims])
        self.node.slot_freed.set()  # the starter's loop looks at them again
        self.node.inbox.put_nowait([])  # (or, waiting on the inbox, it wakes to them)

    def claim_moves(self, dispatches: Sequence[Received]) -> list[fsm.Move]:
        """Scheduling -> Running for each, taking the attempt's lease for this incarnation."""
        owner = str(self.node.boot_id)
        return [
            fsm.plan(d, State.RUNNING, f"started on {d.node}", lease_owner=owner)
            for d, _ in dispatches
        ]

    async def _claim_isolating(self, dispatches: list[Received]) -> int:
        """Claim the dispatches; the one whose claim fails alone is dead-lettered."""
        if not dispatches:
            return 0

        async def dead_letter(received: Received, exc: Exception) -> int:
            log.exception("dispatch %s cannot be claimed", received[0].task_id)
            await self.node.dead_letter(received[1], f"cannot be claimed: {one_line(exc)}")
            return 0

        return await isolate(dispatches, self._claim, dead_letter)

    async def _claim(self, dispatches: Sequence[Received]) -> int:
        node = self.node
        moves = self.claim_moves(dispatches)
        claimed: list[Task] = []
        tries = 0
        sent_at = time.monotonic()  # before the first try: its COMMIT may be the one that held

        async def claim() -> None:
            nonlocal tries
            tries += 1
            claimed[:] = await node.store.tasks.transition_many(moves)

        self.claiming += len(dispatches)
        try:
            with node.claim_window():
                if not await retrying("start", claim, node.stopping):
                    return 0  # shutting down with Postgres away: the dispatches are redelivered
                return await self.settle(dispatches, claimed, tries, sent_at)
        finally:
            self.claiming -= len(dispatches)  # settled: those won are in node.active now

    async def settle(
        self, dispatches: Sequence[Received], claimed: list[Task], tries: int, sent_at: float
    ) -> int:
        """After the claim statement (`tries` sent, the first at monotonic `sent_at`): start
        the attempts it won, drop the dispatches whose task moved on. Returns how many started.
        (The caller counts them off `claiming`: a settle that fails is retried with its claim.)"""
        node = self.node
        won = {t.id: t for t in claimed}
        lost = [d for d, _ in dispatches if d.task_id not in won]
        taken: set[UUID] = set()  # won, then taken away: begun as such (its lease given back)
        if lost and tries > 1:
            # A try whose COMMIT went through but whose reply was lost makes the next try lose
            # to it: a task whose lease this incarnation holds for that attempt is ours.
            wanted = {d.task_id: d.attempt for d in lost}
            for task in await node.store.tasks.get_many(list(wanted)):
                attempt = wanted[task.id]
                if task.lease_owner == node.boot_id and task.lease_attempt == attempt:
                    if not (task.status is State.RUNNING and task.attempt == attempt):
                        taken.add(task.id)  # (its outcome's CAS, from Running, then loses)
                        task = replace(task, status=State.RUNNING, attempt=attempt)
                    won[task.id] = task
        gone = taken | await node.taken_early_from(won)
        messages = {d.task_id: m for d, m in dispatches}
        stale: list[Item | None] = []
        for dispatch, item in dispatches:
            if dispatch.task_id not in won:
                log.info(
                    "dispatch of %s attempt %d is stale (the task moved on); dropped",
                    dispatch.task_id,
                    dispatch.attempt,
                )
                stale.append(item)
        started: list[Item | None] = []
        for task in won.values():
            item, running = messages[task.id], node.active.get((task.id, task.attempt))
            if running is None:
                self._begin(Attempt(task, item, sent_at), taken=task.id in gone)
                started.append(item)
            else:
                # another copy of this attempt was claimed and started meanwhile (a retry that
                # finds the task ours finds that one): never a second start
                stale.append(item)
        # Acknowledged once claimed, not once ended: from the claim on, Postgres (the lease)
        # holds the attempt, and a redelivered copy loses its CAS; held to the outcome, an
        # attempt longer than RabbitMQ's consumer_timeout (30 min by default) had the broker
        # close the node's channel, requeueing every delivery on it, every half hour.
        await node.acks.ack([*stale, *started])
        early = node.taken_early  # named while the look above was on its way: the watch stops it
        node.suspect(set(won) if early is None else early & won.keys())
        return len(started)

    async def _run(self, attempt: Attempt) -> None:
        node, task = self.node, attempt.task
        headers = attempt.message.headers if attempt.message is not None else {}
        with hooks.attempt(task, task.node or node.id, headers) as seen:
            refused = node.policy.refuses(task.spec.job)
            began = time.monotonic()
            try:
                outcome = await self._outcome(attempt, refused)
            except Exception as exc:  # a backend's bug must not leave the attempt hanging
                log.exception("the backend failed running %s attempt %d", task.id, task.attempt)
                outcome = Outcome.failed(f"the backend failed: {one_line(exc)}")
            seen.ended(outcome.ok, outcome.error)
        if attempt.message is not None and node.backlog.ran(time.monotonic() - began):
            node.backlog_changed.set()
        self.ended(attempt, outcome)

    def ended(self, attempt: Attempt, outcome: Outcome) -> None:
        """The attempt's outcome is known: to the finisher (the queue is unbounded)."""
        node, task = self.node, attempt.task
        node.unreported[(task.id, task.attempt)] = outcome
        node.outcomes.put_nowait((attempt, outcome))
        if node.all_reported():
            node.reported.set()

    async def _outcome(self, attempt: Attempt, refused: str | None) -> Outcome:
        node, task = self.node, attempt.task
        if attempt.message is None:  # adopted: its Job runs already; follow it
            return await node.backend.follow((task.id, task.attempt), task.timeout_s)
        if refused:  # the scheduler checks too; this node does not take its word for it
            return Outcome.failed(refused)
        return await node.backend.run(node.launch_of(attempt))

    async def adopt(self, keys: set[Key]) -> int:
        """Take over attempts that run on without the executor that started them (a cluster's
        Jobs): their leases move to this incarnation, and this executor follows them to their
        outcomes. Only attempts still Running are adopted; returns how many."""
        node = self.node
        keys -= set(node.active)
        if not keys:
            return 0
        sent_at = time.monotonic()
        with node.claim_window():
            adopted = await node.store.leases.adopt(node.boot_id, sorted(keys))
            for task in adopted:
                key = (task.id, task.attempt)
                if key in node.active:
                    continue
                log.info("adopted %s attempt %d (its Job runs on)", task.id, task.attempt)
                self._begin(Attempt(task, None, sent_at))
            early = node.taken_early  # canceled meanwhile: the watch loop stops its Job
            node.suspect({t.id for t in adopted} if early is None else early)
        return len(adopted)

    def _begin(self, attempt: Attempt, *, taken: bool = False) -> None:
        node, task = self.node, attempt.task
        key = (task.id, task.attempt)
        node.active[key] = attempt
        if taken:  # canceled or paused before its start: its outcome loses its CAS, as a stop's
            log.info("%s attempt %d was taken away before its start", task.id, task.attempt)
            self.ended(attempt, Outcome.halted())
            return
        if node.stopping.is_set() and attempt.message is not None:
            # claimed while the executor stops (the claim was in flight): its process is
            # not started, as the drain may be past waiting for it; the attempt goes back to
            # Ready as a launch failure (no retry spent), never left Running without a process
            log.info("%s attempt %d claimed while stopping; handed back", task.id, task.attempt)
            self.ended(attempt, Outcome.launch_failed(f"node {node.id} shut down before start"))
            return
        run = asyncio.create_task(self._run(attempt))
        node.runs.add(run)
        run.add_done_callback(node.runs.discard)

    async def _hand_back_unstarted(self) -> None:
        """On shutdown, dispatches received but not started go back to Ready at once, in one
        statement, and back in line with one push."""
        self.gather()
        items, self.held = list(self.held), deque()
        await self.node.hand_back(items, f"node {self.node.id} shut down before start")
