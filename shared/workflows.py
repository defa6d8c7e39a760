"""Running workflows on the store: admit a whole DAG at once, and release or skip a task when
its upstreams finish (the decisions are shared.dag's; the writes go through the FSM).

Release is decided under the downstream task's row lock (`lock_pending`, sql/workflows.sql), in
the same transaction as its CAS: of two deciders woken by two upstreams finishing at once, the
second waits for the first and then finds the task no longer Pending: it is released once.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any
from uuid import NAMESPACE_URL, UUID, uuid5

from shared import fsm
from shared.dag import (
    MAX_INPUTS_BYTES,
    Condition,
    Verdict,
    WorkflowSpec,
    decide,
    effective_priorities,
    inputs_of,
    inputs_too_large,
    too_large,
)
from shared.errors import InvalidSpec
from shared.fsm import State
from shared.jsonvalue import same_json
from shared.models import Task
from shared.store import Store, Tx

log = logging.getLogger(__name__)

ROOT_WALK = (State.PENDING, State.READY)  # no dependencies: ready at once
DEPENDENT_WALK = (State.PENDING,)  # waits for its upstreams


def task_id(workflow_id: UUID, name: str) -> UUID:
    """A workflow task's id: the same for every delivery of the submission."""
    return uuid5(NAMESPACE_URL, f"sked:workflow:{workflow_id}:{name}")


async def admit(
    store: Store, workflow_id: UUID, spec: WorkflowSpec, traceparent: str | None = None
) -> list[Task]:
    """Write the whole workflow in one transaction (or nothing, if it exists already): tasks
    without dependencies go to Ready, the others wait in Pending. Returns the Ready ones."""
    needs = {t.name: [e.task for e in t.needs] for t in spec.tasks}
    spec_of = {t.name: t.spec() for t in spec.tasks}
    priority = effective_priorities({name: s.priority for name, s in spec_of.items()}, needs)
    ids = {t.name: task_id(workflow_id, t.name) for t in spec.tasks}
    roots = [t for t in spec.tasks if not t.needs]
    dependents = [t for t in spec.tasks if t.needs]
    submitted = spec.model_dump(mode="json")
    # Built before the transaction: Python's work between its statements leaves the session
    # idle in it, and Postgres ends one idle past its bound (shared/wiring.idle_in_tx_s);
    # for the largest workflow allowed, the specs alone took seconds.
    groups = [
        (g, [spec_of[t.name] for t in g], walk)
        for g, walk in ((roots, ROOT_WALK), (dependents, DEPENDENT_WALK))
    ]
    deps = [
        (
            ids[t.name],
            ids[e.task],
            e.condition.value,
            e.timeout_s,
            e.on_timeout,
            json.dumps(e.default),
        )
        for t in dependents
        for e in t.needs
    ]
    async with store.transaction() as tx:
        if not await tx.workflows.insert(workflow_id, spec.name, submitted):
            stored = await tx.workflows.spec(workflow_id)
            if stored is None:
                return []  # run and deleted by retention: this submission again (its tombstone)
            if not same_json(stored, submitted):
                raise InvalidSpec(
                    f"workflow id {workflow_id} already names a different workflow: a message id "
                    "stands for one workflow"
                )
            return []  # the same submission again
        ready: list[Task] = []
        for group, specs, walk in groups:
            if not group:
                continue
            tasks = await tx.tasks.create_many(
                specs,
                [ids[t.name] for t in group],
                walk,
                [traceparent] * len(group),
                workflow_id,
                [t.uses for t in group],
                [priority[t.name] for t in group],
            )
            for task, wanted in zip(tasks, group, strict=True):
                if task.id != ids[wanted.name]:  # its idempotency key names another task
                    raise InvalidSpec(
                        f"task {wanted.name!r}: idempotency key "
                        f"{task.idempotency_key!r} already names task {task.id}"
                    )
                if task.workflow_id != workflow_id:
                    # its id (from the workflow's and the task's names, which a producer
                    # may know) was taken before this workflow was: never adopt that task
                    raise InvalidSpec(
                        f"task {wanted.name!r}: its id {task.id} already names a task "
                        "outside this workflow"
                    )
            if walk is ROOT_WALK:
                ready = tasks
        await tx.workflows.insert_deps(deps)
    return ready


# The upstreams' outputs one release statement carries at most (by Postgres's count): each
# task's are within dag.MAX_INPUTS_BYTES, but a wide fan-out released at once added up to
# over a GB, past what Postgres takes in one message, and every pass of every workflow failed.
RELEASE_BYTES = 64 * 1024 * 1024


async def _release(
    tx: Tx, released: Sequence[tuple[Task, str]], upstreams: dict[UUID, list[dict[str, Any]]]
) -> list[Task]:
    """Pending -> Ready for `released`, each with its upstreams' outputs as inputs, fixed now
    in the same CAS; a task whose inputs are too large to carry fails alone, with why. The
    outputs are read for these tasks alone, a batch of at most RELEASE_BYTES at a time."""
    if not released:
        return []
    sizes = await tx.workflows.inputs_sizes([t.id for t, _ in released])
    moved: list[Task] = []
    batches: list[list[tuple[Task, str]]] = [[]]
    fails, used = [], 0
    for task, why in released:
        size = sizes.get(task.id, 0)
        if size > 2 * MAX_INPUTS_BYTES:  # over the limit however compactly written
            why_not = too_large(size) or ""
            fails.append(fsm.plan(task, State.FAILED, why_not, error=why_not))
            continue
        if batches[-1] and used + size > RELEASE_BYTES:
            batches.append([])
            used = 0
        batches[-1].append((task, why))
        used += size
    moved += await tx.tasks.transition_many(fails)
    for batch in batches:
        if not batch:
            continue
        results = await tx.workflows.upstream_results([t.id for t, _ in batch])
        moves = []
        for task, why in batch:
            inputs = inputs_of(
                {**edge, "upstream_result": results.get((task.id, edge["upstream_id"]))}
                for edge in upstreams[task.id]
            )
            over = inputs_too_large(inputs)
            if over is None:
                moves.append(fsm.plan(task, State.READY, why, inputs=inputs))
            else:  # a fan-in too wide to carry: this task fails alone, with the reason
                moves.append(fsm.plan(task, State.FAILED, over, error=over))
        moved += await tx.tasks.transition_many(moves)
        del results, moves
    return moved


async def resolve(store: Store, candidates: Sequence[UUID]) -> tuple[list[Task], list[Task]]:
    """Decide Pending workflow tasks: Pending -> Ready when every edge holds, Pending ->
    Skipped when one can no longer hold; the rest keep waiting. Returns (ready, skipped)."""
    if not candidates:
        return [], []
    async with store.transaction() as tx:
        pending = await tx.workflows.lock_pending(candidates)
        if not pending:
            return [], []
        edges: dict[UUID, list[tuple[Condition, State, str | None]]] = {t.id: [] for t in pending}
        upstreams: dict[UUID, list[dict[str, Any]]] = {t.id: [] for t in pending}
        timed_out: list[tuple[UUID, UUID]] = []
        for row in await tx.workflows.edges_of([t.id for t in pending]):
            upstream = State(row["status"])
            # an upstream that will still move (Failed with a retry left) has not finished
            finished = fsm.is_terminal(upstream, row["retry_count"] < row["max_retries"])
            policy = None
            if not finished and (row["timed_out_at"] is not None or row["overdue"]):
                # waited its maximum (measured from when the task last entered Pending)
                policy = row["on_timeout"]
                if row["timed_out_at"] is None:
                    timed_out.append((row["task_id"], row["upstream_id"]))
            elif row["timed_out_at"] is not None and upstream is not State.SUCCESS:
                # timed out while unfinished, and ended since without success: the decision
                # stands (otherwise whether the task ran with its default depended on which
                # of its upstreams ended first); a success hands on its real output instead
                policy = row["on_timeout"]
            edges[row["task_id"]].append(
                (Condition(row["condition"]), upstream if finished else State.RUNNING, policy)
            )
            upstreams[row["task_id"]].append({**row, "policy": policy})
        await tx.workflows.mark_timed_out(timed_out)
        for task_id, upstream_id in timed_out:
            log.warning("task %s: its dependency on %s timed out", task_id, upstream_id)
        moves = []
        released: list[tuple[Task, str]] = []
        for task in pending:
            verdict, why = decide(edges[task.id])
            if verdict is Verdict.READY:
                released.append((task, why))
            elif verdict is Verdict.SKIP:
                moves.append(fsm.plan(task, State.SKIPPED, why))
            elif verdict is Verdict.FAIL:  # terminal at once: the FSM rule ends its retries
                moves.append(fsm.plan(task, State.FAILED, why, error=why))
        moved = list(await tx.tasks.transition_many(moves))
        moved += await _release(tx, released, upstreams)
    ready = [t for t in moved if t.status is State.READY]
    ended = [t for t in moved if t.status in (State.SKIPPED, State.FAILED)]
    return ready, ended
