"""Cordon, uncordon and drain a node: one path for the CLI and the operator API.

A cordoned node takes no new work: placement leaves it out (`NodeRow.state`; the placement pass
does not even lock it) and a task only it could take waits, parked, saying so. What runs there
runs on: a cordon touches no attempt. Its executor's heartbeats and a re-registration (an
executor restarting) leave the cordon as it is; only `uncordon` lifts it, and tells the
schedulers so that parked tasks are looked at again.

A drain is a cordon, then a wait until no attempt holds the node (Scheduling or Running on it):
every attempt there runs to its end — or moves on by the usual ways (pause, cancel, loss) —
and none starts after. A placement pass that held the node's row when the cordon came commits
first (the cordon waits for its row lock), so what it placed there is among what the drain
waits for. A drain ends with Uncordoned when the cordon it relies on is lifted while it waits
(another operator's uncordon): the node takes new work, so "drained" would be a lie.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from shared.errors import NotAllowed, NotFound
from shared.jsonvalue import note
from shared.store import NodeRow, Store

POLL_S = 0.5  # how often a drain looks at what still holds the node (an operator's wait)


class Uncordoned(NotAllowed):
    """The node's cordon was lifted while a drain waited: it takes new work (API 409)."""


@dataclass(frozen=True)
class Drain:
    node: NodeRow
    holding: list[UUID]  # the attempts (by task) still holding the node when the wait ended

    @property
    def done(self) -> bool:
        return not self.holding and self.node.cordoned_at is not None

    def as_json(self) -> dict[str, Any]:
        return {
            "node": self.node.as_json(),
            "drained": self.done,
            "holding": [str(i) for i in self.holding],
        }


async def node(store: Store, node_id: str) -> NodeRow:
    for row in await store.nodes.all():
        if row.id == node_id:
            return row
    raise NotFound(f"no node {node_id!r}")


async def cordon(store: Store, node_id: str, by: str, reason: str = "") -> NodeRow:
    """No new work on the node (a node cordoned already keeps its first cordon)."""
    by, reason = note("by", by), note("reason", reason)
    if not await store.nodes.cordon(node_id, by, reason):
        raise NotFound(f"no node {node_id!r}")
    return await node(store, node_id)


async def uncordon(store: Store, node_id: str) -> NodeRow:
    if not await store.nodes.uncordon(node_id):
        raise NotFound(f"no node {node_id!r}")
    return await node(store, node_id)


async def drain(
    store: Store, node_id: str, by: str, timeout: float | None = None, reason: str = ""
) -> Drain:
    """Cordon the node, then wait (at most `timeout` seconds; None: as long as it takes) until
    no attempt holds it. `Drain.done` says whether it got there. Raises Uncordoned if the
    cordon is lifted meanwhile (even if cordoned again: the node took work in between)."""
    cordoned_at = (await cordon(store, node_id, by, reason or "drain")).cordoned_at
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        holding = await store.nodes.holders(node_id)
        row = await node(store, node_id)  # after the holders: no attempt came before it
        if row.cordoned_at is None or row.cordoned_at != cordoned_at:
            raise Uncordoned(
                f"node {node_id!r} was uncordoned while the drain waited: it takes new work "
                "and is not drained (cordon it again, or drain it again, when it is meant)"
            )
        left = None if deadline is None else deadline - time.monotonic()
        if not holding or (left is not None and left <= 0):
            return Drain(row, holding)
        await asyncio.sleep(POLL_S if left is None else min(POLL_S, left))
