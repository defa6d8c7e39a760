"""Nodes: executors register and refresh themselves; placement reads them with their usage,
under their row locks. A node's usage is not a counter that could drift: it is the sum over the
attempts that hold it (Scheduling or Running on it), released by the very CAS that ends them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

from shared.degrade import Mode, in_force
from shared.placement import NodeState
from shared.store.db import Db
from shared.store.queries import Q

NODE_CHANNEL = "sked_node"  # NOTIFY when a node joins, leaves or changes readiness


@dataclass(frozen=True)
class NodeRow:
    id: str
    slots: int
    cpu: float
    memory_mb: int
    gpu: int
    labels: Mapping[str, str]
    ready: bool
    live: bool
    load: float
    boot_id: UUID
    registered_at: datetime
    heartbeat_at: datetime
    used_slots: int
    used_cpu: float
    used_memory_mb: int
    used_gpu: int
    # cordoned: takes no new work (what runs there runs on); kept across re-registration
    cordoned_at: datetime | None = None
    cordoned_by: str | None = None
    cordon_reason: str | None = None
    prefetch: int = 0  # dispatches held beyond its slots, started as slots free

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> NodeRow:
        values = {k: v for k, v in row.items() if not k.startswith("degrade_")}
        values["used_cpu"] = float(values["used_cpu"])
        values["used_memory_mb"] = int(values["used_memory_mb"])
        values["used_gpu"] = int(values["used_gpu"])
        # The row as placement may trust it, whatever was written to it by hand (its CHECKs
        # let through a jsonb that is no object, and a cpu of NaN or Infinity): labels are an
        # object of strings, and a capacity that is no finite number is none at all, so the
        # node is said to be too small rather than full (a task would wait on it for ever).
        labels = values["labels"]
        labels = labels if isinstance(labels, dict) else {}
        values["labels"] = {k: v for k, v in labels.items() if isinstance(v, str)}
        if not math.isfinite(values["cpu"]):  # memory_mb and gpu are integer columns
            values["cpu"] = 0.0
        return cls(**values)

    def state(self) -> NodeState:
        """What placement sees: a node that stopped heartbeating, or is cordoned, is not
        ready (`cordoned` says a live node is left out only for its cordon)."""
        up = self.ready and self.live
        return NodeState(
            id=self.id,
            slots=self.slots,
            prefetch=self.prefetch,
            cpu=self.cpu,
            memory_mb=self.memory_mb,
            gpu=self.gpu,
            labels=self.labels,
            ready=up and self.cordoned_at is None,
            cordoned=up and self.cordoned_at is not None,
            load=self.load,
            heard_at=self.heartbeat_at.timestamp(),
            used_slots=self.used_slots,
            used_cpu=self.used_cpu,
            used_memory_mb=self.used_memory_mb,
            used_gpu=self.used_gpu,
        )

    def as_json(self) -> dict[str, Any]:
        out = dict(vars(self))
        out["boot_id"] = str(self.boot_id)
        for key in ("registered_at", "heartbeat_at", "cordoned_at"):
            out[key] = None if out[key] is None else out[key].isoformat()
        out["labels"] = dict(self.labels)
        return out


class Nodes:
    def __init__(self, db: Db, ttl_s: float) -> None:
        self.db = db
        self.ttl_s = ttl_s  # a node silent this long is not live

    async def register(
        self,
        node_id: str,
        slots: int,
        cpu: float,
        memory_mb: int,
        gpu: int,
        labels: Mapping[str, str],
        boot_id: UUID,
        prefetch: int = 0,
    ) -> None:
        await self.db.execute(
            Q.register_node, node_id, slots, cpu, memory_mb, gpu, dict(labels), boot_id, prefetch
        )

    async def heartbeat(
        self, node_id: str, boot_id: UUID, load: float, prefetch: int | None = None
    ) -> bool:
        """Refresh the node (and its backlog, unless None); False if another executor has
        since taken over this node id."""
        args = (node_id, boot_id, load, prefetch, self.ttl_s)
        found = await self.db.fetchval(Q.node_heartbeat, *args)
        return found is not None

    async def owner(self, node_id: str) -> UUID | None:
        """The boot id the node's row names; None: no row (never registered, or forgotten)."""
        owner: UUID | None = await self.db.fetchval(Q.node_owner, node_id)
        return owner

    async def forget(self, gone_for_s: float) -> list[str]:
        """Delete the nodes silent `gone_for_s` or longer that hold no attempt and are not
        cordoned; returns their ids."""
        return [r["id"] for r in await self.db.fetch(Q.forget_nodes, gone_for_s)]

    async def set_prefetch(self, node_id: str, boot_id: UUID, prefetch: int) -> None:
        """The backlog the node holds now (shared/backlog.py)."""
        await self.db.execute(Q.set_node_prefetch, node_id, boot_id, prefetch)

    async def set_ready(self, node_id: str, boot_id: UUID, ready: bool) -> None:
        await self.db.execute(Q.set_node_ready, node_id, boot_id, ready)

    async def leave(self, node_id: str, boot_id: UUID) -> None:
        """Its executor stops cleanly: not ready, and not counted as a node lost."""
        await self.db.execute(Q.leave_node, node_id, boot_id)

    async def all(self) -> list[NodeRow]:
        return (await self.read())[0]

    async def lock_and_read(self) -> tuple[list[NodeRow], Mode | None]:
        """Inside a transaction: lock the live nodes, then read every node with its usage, and
        the degrade mode in force (None if there is no node row to carry it) — one round trip
        (sked_nodes, sql/nodes.sql, says why the read is a statement of its own).

        Only the nodes locked here count as live: one that turned live between the lock and
        the read waits for the next pass rather than being placed on unlocked. Cordoned nodes
        are not locked (nothing is placed on them) and stay as read, cordon and all, so that
        a task no other node can take says so.
        """
        assert self.db.in_transaction, "placement locks nodes inside a transaction"
        return _with_mode(await self.db.fetch(Q.lock_and_read_nodes, self.ttl_s))

    async def read(self) -> tuple[list[NodeRow], Mode | None]:
        """Every node with its usage, and the degrade mode in force, as `lock_and_read` reads
        them but without a lock: what a placement planned ahead of its statement sees (that
        statement checks again under the locks: `Tasks.admit_many`'s `placing`)."""
        return _with_mode(await self.db.fetch(Q.nodes_with_usage, self.ttl_s))

    async def cordon(self, node_id: str, by: str, reason: str = "") -> bool:
        """Cordon the node (no new work; what runs there runs on); False if unknown. A node
        cordoned already keeps its first cordon."""
        return await self.db.fetchval(Q.cordon_node, node_id, by, reason) is not None

    async def uncordon(self, node_id: str) -> bool:
        """Lift the node's cordon (parked tasks are looked at again); False if unknown."""
        return await self.db.fetchrow(Q.uncordon_node, node_id) is not None

    async def holders(self, node_id: str) -> list[UUID]:
        """The tasks whose attempts hold the node (Scheduling or Running on it)."""
        return [r["id"] for r in await self.db.fetch(Q.node_holders, node_id)]


def _with_mode(rows: list[Any]) -> tuple[list[NodeRow], Mode | None]:
    """sked_nodes' rows as nodes, and the degrade mode each carries (None without a node)."""
    mode = None
    if rows and rows[0]["degrade_mode"] is not None:
        mode = in_force(Mode(rows[0]["degrade_mode"]), rows[0]["degrade_remaining_s"])
    return [NodeRow.from_row(r) for r in rows], mode
