"""The scheduler's wake-ups in one place: what each notification, and each loop's own result,
wakes — and what it tells the woken loop. No loop polls in a hot loop; each waits on its event
here, with a slow timer as the backstop for a missed notification."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping, Sequence
from uuid import UUID

from services.scheduler.queued import QueuedTasks
from shared.degrade import DegradeState, Mode
from shared.fsm import State
from shared.placement import NodeState
from shared.queues import ReadyQueue
from shared.settings import Settings
from shared.store import Store, parse_notify
from shared.store.notify import NOTIFY_LIST_MAX, states_of, versions_of

# A NOTIFY naming one of these states may have freed capacity on a node (or made a task Ready).
FREES_CAPACITY = {
    s.value
    for s in (
        State.SUCCESS,
        State.FAILED,
        State.TIMED_OUT,
        State.LOST,
        State.CANCELED,
        State.PAUSED,
        State.RETRY_WAIT,
        State.READY,
    )
}

READY_ONLY = frozenset({State.READY.value})
ADMITTED_MAX = 10_000  # ids kept in `Hub.admitted` at most (~1 MB)

# A NOTIFY naming one of these may decide workflow tasks downstream.
DECIDES_DOWNSTREAM = {
    s.value for s in (State.SUCCESS, State.FAILED, State.TIMED_OUT, State.CANCELED, State.SKIPPED)
}


class DegradeView:
    """This scheduler's copy of the degrade mode: the row as last read, and its end as a
    deadline on this host's monotonic clock (the seconds Postgres said were left, counted
    from the read), so a mode ends here on time whatever this host's wall clock says."""

    def __init__(self) -> None:
        self.state: DegradeState | None = None
        self.deadline: float | None = None

    def set(self, state: DegradeState, read_at: float) -> None:
        self.state = state
        left = state.remaining_s
        self.deadline = None if left is None else read_at + left

    def mode(self) -> Mode:
        if self.state is None:
            return Mode.NORMAL
        if self.deadline is not None and time.monotonic() >= self.deadline:
            return Mode.NORMAL
        return self.state.effective()

    def seconds_left(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())


class Hub:
    def __init__(self) -> None:
        # dispatch: a pass may place something; new work cuts its linger short
        self.dispatch = asyncio.Event()
        self.new_work = asyncio.Event()
        # nodes changed: tasks parked because no node could take them go back in line
        self.unpark = asyncio.Event()
        # a task ended (or an attempt gave its lease back): tasks waiting for a named resource
        # or for an earlier attempt's lease go back in line. `ends` counts those
        # notifications, so a pass that parked after one arrived knows it missed it. Only a
        # scheduler that parked some does this on its dispatch path (a Redis round trip per
        # pass otherwise): `waiting_aside` holds the sets it parked them in (RESOURCE_KEY,
        # FENCED_KEY). The reconcile period covers a parker that died, and a lease run out.
        self.unpark_resources = asyncio.Event()
        self.ends = 0
        self.waiting_aside: set[str] = set()
        # tasks this scheduler's intake admitted, by id, with the version their admission
        # gives them, until that Ready is heard: intake placed each or queued it and woke
        # dispatch itself, so the notification asks for nothing (at low rates it cost a pass,
        # a Redis round trip, per submission). The version keeps a later Ready of the same
        # task (an attempt coming back) from ever passing for it.
        self.admitted: dict[UUID, int] = {}
        # workflows: tasks that finished (or were resumed) lately, or all of them
        self.resolve = asyncio.Event()
        self.finished: set[UUID] = set()
        self.resolve_all = True
        # retries: a task entered RetryWait
        self.retry = asyncio.Event()
        # schedule timeouts: a task with a deadline entered Ready, so the earliest may be earlier
        self.deadlines = asyncio.Event()
        # degrade: the mode row changed (NOTIFY sked_degrade); dispatch obeys `degrade`
        self.degrade = DegradeView()
        # the tasks intake and dispatch put in line, as they put them there (queued.py)
        self.queued = QueuedTasks()
        self.degrade_changed = asyncio.Event()
        # counts the notifications of nodes or the degrade mode changing (and LISTEN coming
        # back): a view of the nodes read before a change is not planned on (ahead.NodeView)
        self.node_changes = 0
        # parked tasks asked back into line (a node changed, a task ended while some wait
        # aside), and the asks the dispatch loop has carried out: while one is outstanding,
        # intake places nothing ahead (a parked task that fits now may be older or higher)
        self.returns_asked = 0
        self.returns_done = 0
        # the line was found lost (Redis lost its data): the reconciler rebuilds it now
        self.rebuild = asyncio.Event()
        # intake found Redis silent: submissions are left to other schedulers until it answers
        self.redis_away = asyncio.Event()
        # nodes whose dispatches came back (no queue bound), until when (monotonic) they are
        # passed over by the passes and by intake's placing ahead (dispatch.UNROUTABLE_S)
        self.unroutable: dict[str, float] = {}

    def work_arrived(self) -> None:
        """Intake, a retry, a release or a parked task's return queued work: dispatch now."""
        self.new_work.set()
        self.dispatch.set()

    def task_notify(self, _c: object, _p: int, _ch: str, payload: str) -> None:
        # The states first, without the ids: the ids are read (a UUID an entry) only where a
        # decision needs them, and the marks `:w:` and `:d:` are looked for in the payload
        # before that — most notifications (the ends of standalone tasks) need none of it.
        states = states_of(payload)
        listed = not payload.startswith("*:")
        # only a workflow's task has downstream tasks or upstreams to wait for: the others'
        # ends (almost all, under load) cost resolution nothing
        if states & DECIDES_DOWNSTREAM or State.PENDING.value in states:
            if not listed:
                self.resolve_all = True
                self.resolve.set()
            elif ":w:" in payload and (members := parse_notify(payload).workflow_ids):
                self.finished.update(members)
                self.resolve.set()
        if states & FREES_CAPACITY and not self._own_admission(states, payload, listed):
            self.ends += 1
            if self.waiting_aside:
                self.returns_asked += 1
            self.unpark_resources.set()
            self.dispatch.set()
        if State.RETRY_WAIT.value in states:
            self.retry.set()
        if State.READY.value in states and (
            not listed or (":d:" in payload and parse_notify(payload).deadline_ids)
        ):
            # only a task with a schedule deadline can bring the earliest one closer: the
            # others (most) cost the timeout loop no look at the index
            self.deadlines.set()

    def admitting(self, versions: Mapping[UUID, int]) -> None:
        """Intake is about to commit the admission of these tasks, at these versions (see
        `admitted`). A batch too big for its notification to list is not kept: that
        notification asks for a pass."""
        if len(versions) > NOTIFY_LIST_MAX:
            return
        if len(self.admitted) > ADMITTED_MAX:  # notifications missed (LISTEN dropped)
            self.admitted.clear()  # a pass more for the rest, nothing missed
        self.admitted.update(versions)

    def forget_admitting(self, ids: Iterable[UUID]) -> None:
        """Tasks `admitting` was told of that the admission did not create (they existed):
        no notification of theirs is coming."""
        for task_id in ids:
            self.admitted.pop(task_id, None)

    def _own_admission(self, states: frozenset[str], payload: str, listed: bool) -> bool:
        """Whether a notification is only the Ready of tasks this scheduler admitted, each at
        its admission's version (then forgotten)."""
        admitted = self.admitted
        if not listed or states != READY_ONLY or not admitted:
            return False
        versions = versions_of(payload)  # None: an entry that is not sked's (anyone may NOTIFY)
        if not versions or not versions.keys() <= admitted.keys():
            return False
        if any(admitted[i] != v for i, v in versions.items()):
            return False
        for task_id in versions:
            del admitted[task_id]
        return True

    def degrade_notify(self, *_: object) -> None:
        self.node_changes += 1
        self.degrade_changed.set()

    def node_notify(self, *_: object) -> None:
        """A node joined or changed: parked tasks may fit now."""
        self.node_changes += 1
        self.ask_unpark()
        self.dispatch.set()

    def ask_unpark(self) -> None:
        """Parked tasks go back in line at the dispatch loop's next turn."""
        self.returns_asked += 1
        self.unpark.set()

    def routable(self, nodes: Sequence[NodeState]) -> list[NodeState]:
        """`nodes`, those whose dispatches came back lately shown full: what would fit there
        waits in line for them, as for any full node (left out, the tasks that fit only
        there were parked as fitting nowhere, until some node changed)."""
        if not self.unroutable:
            return list(nodes)
        now = time.monotonic()
        for node, until in list(self.unroutable.items()):
            if until <= now:
                del self.unroutable[node]
        return [n.full() if n.id in self.unroutable else n for n in nodes]

    def returns_pending(self) -> bool:
        """Whether tasks asked back in line may not be there yet (intake: no placing ahead)."""
        return self.returns_done != self.returns_asked

    def missed(self) -> None:
        """After LISTEN came back: anything may have happened meanwhile — look at all of it."""
        self.node_changes += 1
        self.ask_unpark()
        self.unpark_resources.set()
        self.retry.set()
        self.deadlines.set()
        self.degrade_changed.set()
        self.dispatch.set()
        self.resolve_all = True
        self.resolve.set()


class Part:
    """What each of the scheduler's loops works with: its settings, the store, the ready queue
    and the hub that wakes it."""

    def __init__(self, settings: Settings, store: Store, queue: ReadyQueue, hub: Hub) -> None:
        self.settings = settings
        self.store = store
        self.queue = queue
        self.hub = hub
