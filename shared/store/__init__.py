"""Postgres, and the only place SQL lives (the statements are in sql/*.sql, named and
described; `queries` loads them). One class per aggregate — tasks, claims, leases, workflows,
nodes, outbox, late results, launches, API tokens — and a unit of work:

    store = await Store.open(settings)
    task = await store.tasks.get(task_id)            # each call its own transaction
    async with store.transaction() as tx:            # or several in one
        moved = await tx.tasks.transition_many(moves)
        await tx.late.record(results)

Nothing outside the store touches a pool or a connection.

Importing this package loads nothing but this module: each name below is loaded from its
module on first use (PEP 562), so a process that reads one task (`sked status`, through
`shared.store.quick`) does not pay for every aggregate, the models and pydantic.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shared.lazy import exports

if TYPE_CHECKING:
    from shared.store.degrade import (
        DEGRADE_CHANNEL as DEGRADE_CHANNEL,
    )
    from shared.store.gauges import (
        ClusterCounts as ClusterCounts,
    )
    from shared.store.gauges import (
        ClusterGauges as ClusterGauges,
    )
    from shared.store.nodes import (
        NODE_CHANNEL as NODE_CHANNEL,
    )
    from shared.store.nodes import (
        NodeRow as NodeRow,
    )
    from shared.store.notify import (
        STARTED_CHANNEL as STARTED_CHANNEL,
    )
    from shared.store.notify import (
        TAKEN_CHANNEL as TAKEN_CHANNEL,
    )
    from shared.store.notify import (
        TASK_CHANNEL as TASK_CHANNEL,
    )
    from shared.store.notify import (
        Handler as Handler,
    )
    from shared.store.notify import (
        Notice as Notice,
    )
    from shared.store.notify import (
        may_name as may_name,
    )
    from shared.store.notify import (
        parse_notify as parse_notify,
    )
    from shared.store.outbox import (
        OutboxRow as OutboxRow,
    )
    from shared.store.store import (
        Store as Store,
    )
    from shared.store.store import (
        Tx as Tx,
    )
    from shared.store.tasks import (
        Placing as Placing,
    )
    from shared.store.tasks import (
        QueuedRow as QueuedRow,
    )

_WHERE = {
    "DEGRADE_CHANNEL": "degrade",
    "NODE_CHANNEL": "nodes",
    "STARTED_CHANNEL": "notify",
    "TAKEN_CHANNEL": "notify",
    "TASK_CHANNEL": "notify",
    "ClusterCounts": "gauges",
    "ClusterGauges": "gauges",
    "Handler": "notify",
    "NodeRow": "nodes",
    "Notice": "notify",
    "OutboxRow": "outbox",
    "Placing": "tasks",
    "QueuedRow": "tasks",
    "Store": "store",
    "Tx": "store",
    "may_name": "notify",
    "parse_notify": "notify",
}

__all__ = [
    "DEGRADE_CHANNEL",
    "NODE_CHANNEL",
    "STARTED_CHANNEL",
    "TAKEN_CHANNEL",
    "TASK_CHANNEL",
    "ClusterCounts",
    "ClusterGauges",
    "Handler",
    "NodeRow",
    "Notice",
    "OutboxRow",
    "Placing",
    "QueuedRow",
    "Store",
    "Tx",
    "may_name",
    "parse_notify",
]


__getattr__ = exports(__name__, {name: f"{__name__}.{where}" for name, where in _WHERE.items()})
