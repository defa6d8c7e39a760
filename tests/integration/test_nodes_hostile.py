"""Regression tests for the adversarial review's findings on node registration, capacity and
placement inputs: each failed on the code as it was and passes now that its finding is fixed."""

from __future__ import annotations

import asyncio
from typing import Any
from uuid import uuid4

import asyncpg
import pytest

from services.executor.backends.kubernetes.manifest import node_offer
from services.executor.service import Executor
from services.executor.serving import Serving
from shared.errors import InvalidSettings
from shared.placement import Need, place_many
from shared.settings import Settings
from shared.store import Store
from shared.store.nodes import Nodes


def _kube_node(name: str, pods: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": {}},
        "status": {
            "allocatable": {"pods": pods, "cpu": "4", "memory": "8Gi"},
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


async def test_a_cluster_node_with_many_pods_does_not_stop_the_executor(
    executor: Executor, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Kubernetes node whose allocatable pods exceed 65,535 (kubelet --max-pods is the
    cluster's to set; node_offer clamps it only to 2**31-1) makes `Serving.sync` call
    `set_qos(prefetch_count=slots + prefetch)`, and AMQP's prefetch_count is a 16-bit field:
    pamqp raises TypeError, which is no TRANSIENT error, so the nodes loop dies and the
    cluster executor stops serving every node, the healthy ones included. Worse, the row was
    registered ready *before* the qos call, so placement sends work for a TTL to a queue
    nobody consumes. Fixed: the per-consumer prefetch is capped at 65,535
    (serving.prefetch_count) in services/executor/serving.py and service.py."""
    offers = {
        "big": node_offer(_kube_node("big", "70000")),
        "small": node_offer(_kube_node("small", "10")),
    }
    monkeypatch.setattr(executor.node.backend, "offers", lambda: offers)
    node = executor.node
    channel = await node.bus.consumer_channel(prefetch=4)
    probes = await channel.declare_queue(exclusive=True, auto_delete=True)
    serving = Serving(node, channel, probes)
    try:
        async with asyncio.timeout(20):
            await serving.sync()  # raises TypeError: Short unsigned integer range
        assert set(serving.served) == {"big", "small"}
    finally:
        await channel.close()


@pytest.mark.parametrize(
    "values",
    [
        {"node_id": "x" * 64},  # the nodes.id CHECK allows 63 characters
        {"node_id": "bad id"},  # nor spaces
        {"node_id": "-lead"},  # nor a leading dash
        {"node_id": ""},  # SKED_NODE_ID= (set, empty)
        {"node_memory_mb": 2**63},  # nodes.memory_mb is a bigint
        {"node_gpu": 2**31},  # nodes.gpu is an integer
        {"node_labels": '{"zone": "\\u0000"}'},  # jsonb holds no NUL
    ],
)
async def test_settings_refuse_a_node_its_row_cannot_hold(
    values: dict[str, Any], store: Store
) -> None:
    """`Settings` accepts SKED_NODE_ID values that nodes.id's CHECK
    (^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$) refuses, and SKED_NODE_MEMORY_MB / SKED_NODE_GPU past
    their columns, and SKED_NODE_LABELS whose JSON holds a \\u0000 (jsonb refuses it; JSON
    null or objects are turned into the strings 'None' / a Python repr): the executor
    starts, declares its queue, then dies in setup on a raw CheckViolation / overflow from
    Postgres instead of a clear InvalidSettings naming the variable (and a supervisor
    restarts it in a loop). The Kubernetes path already checks
    names (_NODE_ID) and clamps to the columns; the local path did not. Fixed: the nodes.id
    pattern on node_id (NODE_ID_PATTERN, shared with the Kubernetes path: 63 characters at
    most), le=2**63-1 on node_memory_mb and le=2**31-1 on node_gpu, and
    parse_labels refusing NULs and non-string values, in shared/settings_model.py."""
    try:
        s = Settings(**values)
    except InvalidSettings:
        return  # refused up front: what the fix does
    # accepted: show that the registration it leads to fails
    with pytest.raises((asyncpg.PostgresError, OverflowError, ValueError)):
        await store.nodes.register(
            s.node_id, s.slots, s.node_cpu, s.node_memory_mb, s.node_gpu, s.node_labels, uuid4()
        )
    pytest.fail(f"Settings accepted {values!r}, which the node's row refuses")


async def test_one_hand_edited_labels_value_stops_placement_everywhere(
    store: Store, pool: asyncpg.Pool
) -> None:
    """nodes.labels is any jsonb: an operator's hand edit (or a tool) that stores a JSON array
    or string there makes `matches` call `.get` on a list, so every placement of a task with a
    selector raises AttributeError — on every node, not only the broken one — and the
    dispatch pass (Dispatcher.dispatch_once) fails every time: the scheduler places nothing
    with a selector anywhere. `sked nodes` crashes on the same row (labels.items()). Fixed on
    the read side: NodeRow.from_row (shared/store/nodes.py) takes labels that are no JSON
    object as {} and keeps string values only (no migration: the column still takes any
    jsonb)."""
    await store.nodes.register("good", 4, 4.0, 1024, 0, {"zone": "a"}, uuid4())
    await store.nodes.register("odd", 4, 4.0, 1024, 0, {"zone": "b"}, uuid4())
    await pool.execute("""UPDATE nodes SET labels = '["zone"]' WHERE id = 'odd'""")
    nodes = [n.state() for n in await store.nodes.all()]
    placed, _ = place_many([("t", Need(selector={"zone": "a"}))], nodes)
    assert placed == {"t": "good"}


async def test_a_nan_cpu_node_row_is_not_reported_as_full(store: Store, pool: asyncpg.Pool) -> None:
    """nodes.cpu's CHECK (cpu >= 0) lets 'NaN' in (Postgres orders NaN above every number).
    Placement then says of an empty node 'all 1 node(s) that fit are full' and keeps the task
    in line forever (fits_later=True): `capacity_gap` compares NaN + EPS < need (False: no
    gap) while `fits` compares used + need <= NaN (False: no room). A task waits on a lie.
    Fixed on the read side: NodeRow.from_row (shared/store/nodes.py) takes a cpu that is no
    finite number as 0, so placement says no node has the cpu, and parks the task (no
    migration: the column still takes NaN)."""
    await store.nodes.register("n", 4, 4.0, 1024, 0, {}, uuid4())
    await pool.execute("UPDATE nodes SET cpu = 'NaN' WHERE id = 'n'")
    nodes = [n.state() for n in await store.nodes.all()]
    placed, unplaced = place_many([("t", Need(cpu=1.0))], nodes)
    assert placed or not unplaced["t"].fits_later, unplaced["t"].reason
    assert unplaced["t"].reason == "no node has cpu >= 1"


async def test_a_heartbeat_period_past_the_node_ttl_is_refused(
    store: Store, pool: asyncpg.Pool
) -> None:
    """SKED_NODE_HEARTBEAT_S is not checked against SKED_NODE_TTL_S: with a period of 30 s and
    the default TTL of 10 s a healthy executor's node is dead to placement two thirds of the
    time (every task submitted then is parked 'no ready node', woken by the next beat's NOTIFY,
    and the degrade healthy-nodes trigger counts it down), and with a period just under the
    TTL it flaps on any delay. Settings checks node_forget_s against node_ttl_s already; fixed
    by the same kind of model validator in shared/settings_model.py requiring
    node_heartbeat_s <= node_ttl_s / 2."""
    try:
        Settings(node_heartbeat_s=30.0, node_ttl_s=10.0)
    except InvalidSettings:
        return
    # accepted: what placement sees of such a node 10 s after its last beat
    await store.nodes.register("slow", 2, 1.0, 64, 0, {}, uuid4())
    await pool.execute("UPDATE nodes SET heartbeat_at = now() - interval '11 seconds'")
    (row,) = await Nodes(store.nodes.db, 10.0).all()
    pytest.fail(f"Settings accepted a 30 s beat with a 10 s TTL; between beats live={row.live}")
