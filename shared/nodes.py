"""Nodes in Postgres: executors register and refresh themselves; schedulers read them with usage.

A node's usage is not a counter that could drift: it is the sum over the tasks that hold it
(Scheduling or Running on that node), so a reservation is released exactly when its attempt
leaves those states, by the same CAS that moves the task.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any
from uuid import UUID

import asyncpg

from shared.placement import NodeState

NODE_CHANNEL = "sked_node"  # NOTIFY when a node joins, leaves or changes readiness

REGISTER = f"""
WITH up AS (
    INSERT INTO nodes (id, slots, cpu, memory_mb, gpu, labels, ready, boot_id)
    VALUES ($1, $2, $3, $4, $5, $6::jsonb, true, $7)
    ON CONFLICT (id) DO UPDATE SET
        slots = EXCLUDED.slots, cpu = EXCLUDED.cpu, memory_mb = EXCLUDED.memory_mb,
        gpu = EXCLUDED.gpu, labels = EXCLUDED.labels, ready = true, boot_id = EXCLUDED.boot_id,
        registered_at = now(), heartbeat_at = now()
    RETURNING id
)
SELECT pg_notify('{NODE_CHANNEL}', id) FROM up
"""

# An executor's heartbeat also re-asserts that it is ready (a monitor may have marked it not
# ready while it was only reconnecting); a draining executor stops heartbeating first.
HEARTBEAT = """
UPDATE nodes SET heartbeat_at = now(), load = $3, ready = true
WHERE id = $1 AND boot_id = $2
RETURNING ready
"""

SET_READY = f"""
WITH up AS (
    UPDATE nodes SET ready = $3, heartbeat_at = now() WHERE id = $1 AND boot_id = $2
    RETURNING id
)
SELECT pg_notify('{NODE_CHANNEL}', id) FROM up
"""

_WITH_USAGE = """
SELECT n.id, n.slots, n.cpu, n.memory_mb, n.gpu, n.labels, n.ready, n.load, n.boot_id,
       n.registered_at, n.heartbeat_at,
       n.heartbeat_at > now() - make_interval(secs => $1) AS live,
       COALESCE(u.used_slots, 0) AS used_slots, COALESCE(u.used_cpu, 0) AS used_cpu,
       COALESCE(u.used_memory_mb, 0) AS used_memory_mb, COALESCE(u.used_gpu, 0) AS used_gpu
FROM nodes n
LEFT JOIN (
    SELECT node, count(*) AS used_slots, sum(cpu) AS used_cpu,
           sum(memory_mb) AS used_memory_mb, sum(gpu) AS used_gpu
    FROM tasks WHERE status IN ('scheduling', 'running') GROUP BY node
) u ON u.node = n.id
"""

ALL_WITH_USAGE = _WITH_USAGE + " ORDER BY n.id"

# Placement runs with the live nodes' rows locked (in id order, so schedulers never deadlock):
# two schedulers placing at once serialise here and each sees the other's reservations. The
# lock and the read of usage must be two statements: at READ COMMITTED a statement reads as of
# its own start, so usage read by the statement that waited for the lock would miss what the
# previous holder committed meanwhile (a test reproduces that overcommit step by step).
LOCK_LIVE = """
SELECT id FROM nodes
WHERE ready AND heartbeat_at > now() - make_interval(secs => $1)
ORDER BY id
FOR UPDATE
"""


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

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> NodeRow:
        values = dict(row)
        values["used_cpu"] = float(values["used_cpu"])
        values["used_memory_mb"] = int(values["used_memory_mb"])
        values["used_gpu"] = int(values["used_gpu"])
        return cls(**values)

    def state(self) -> NodeState:
        """What placement sees: a node that stopped heartbeating is not ready."""
        return NodeState(
            id=self.id,
            slots=self.slots,
            cpu=self.cpu,
            memory_mb=self.memory_mb,
            gpu=self.gpu,
            labels=self.labels,
            ready=self.ready and self.live,
            load=self.load,
            used_slots=self.used_slots,
            used_cpu=self.used_cpu,
            used_memory_mb=self.used_memory_mb,
            used_gpu=self.used_gpu,
        )

    def as_json(self) -> dict[str, Any]:
        out = dict(vars(self))
        for key in ("boot_id", "registered_at", "heartbeat_at"):
            out[key] = str(out[key]) if key == "boot_id" else out[key].isoformat()
        out["labels"] = dict(self.labels)
        return out


class PgNodeRepo:
    def __init__(self, pool: asyncpg.Pool, ttl_s: float) -> None:
        self.pool = pool
        self.ttl_s = ttl_s

    async def register(
        self,
        node_id: str,
        slots: int,
        cpu: float,
        memory_mb: int,
        gpu: int,
        labels: Mapping[str, str],
        boot_id: UUID,
    ) -> None:
        await self.pool.execute(
            REGISTER, node_id, slots, cpu, memory_mb, gpu, dict(labels), boot_id
        )

    async def heartbeat(self, node_id: str, boot_id: UUID, load: float) -> bool:
        """Refresh the node; False if another executor has since taken over this node id."""
        return await self.pool.fetchval(HEARTBEAT, node_id, boot_id, load) is not None

    async def set_ready(self, node_id: str, boot_id: UUID, ready: bool) -> None:
        await self.pool.execute(SET_READY, node_id, boot_id, ready)

    async def all(self) -> list[NodeRow]:
        return [NodeRow.from_row(r) for r in await self.pool.fetch(ALL_WITH_USAGE, self.ttl_s)]

    async def lock_and_read(self, conn: asyncpg.Connection) -> list[NodeRow]:
        """Inside a transaction: lock the live nodes, then read every node with its usage.

        Only the nodes locked here count as live: one that turned live between the lock and
        the read waits for the next pass rather than being placed on unlocked.
        """
        locked = {r["id"] for r in await conn.fetch(LOCK_LIVE, self.ttl_s)}
        rows = [NodeRow.from_row(r) for r in await conn.fetch(ALL_WITH_USAGE, self.ttl_s)]
        return [r if r.id in locked else replace(r, live=False) for r in rows]
