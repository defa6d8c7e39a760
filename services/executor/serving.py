"""The nodes one executor serves, as placement and the bus see them.

A local executor is one node, as configured (SKED_NODE_ID, SKED_SLOTS, ...): its row is owned
by this incarnation, so a second executor started with the same node id takes the node over
and the first stops. A cluster backend (Kubernetes) offers many nodes that come and go; their
rows are owned by the cluster (a fixed id per node), so several replicas may serve one cluster
and refresh the same rows. For each node served: its row in Postgres, its dispatch queue
(consumed with a prefetch of its slots). Probes are answered for every node the backend
knows, ready or not: the attempts on a node that turned NotReady are still this executor's to
judge (the backend's loss ladder), or another replica's to adopt.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from uuid import NAMESPACE_URL, UUID, uuid5

import aiormq.exceptions
from aio_pika import ExchangeType
from aio_pika.abc import AbstractChannel, AbstractQueue

from services.executor.backends import NodeOffer
from services.executor.node import Node
from shared.bus import PROBE_EXCHANGE
from shared.resilience import TRANSIENT
from shared.settings import Settings
from shared.throttle import Throttled

# AMQP's basic.qos prefetch_count is a 16-bit field: a larger count (a cluster node with
# more than 65,535 allocatable pods) is refused by the client library with a TypeError,
# which would stop the nodes loop and with it every node this executor serves.
MAX_PREFETCH = 65_535


# The longest the declarations of one reassert may take: a partition that swallows packets
# held the nodes loop, and with it the node's heartbeats to Postgres, until AMQP's heartbeats
# noticed (SkedNodeLost fired for a node running its attempts)
REASSERT_S = 5.0


def prefetch_count(count: int) -> int:
    """A consumer's prefetch as AMQP can carry it: at most MAX_PREFETCH."""
    return min(count, MAX_PREFETCH)


log = logging.getLogger(__name__)


def cluster_owner(node_id: str) -> UUID:
    """The owner id of a cluster node's row: the same for every replica serving it."""
    return uuid5(NAMESPACE_URL, f"sked:cluster-node:{node_id}")


def local_offer(settings: Settings) -> NodeOffer:
    s = settings
    return NodeOffer(
        s.node_id,
        s.slots,
        s.node_cpu,
        s.node_memory_mb,
        s.node_gpu,
        s.node_labels,
        True,
        prefetch=s.backlog_limit,
    )


@dataclass
class Served:
    offer: NodeOffer
    owner: UUID
    queue: AbstractQueue
    tag: str


class Serving:
    def __init__(self, node: Node, channel: AbstractChannel, probes: AbstractQueue) -> None:
        self.node = node
        self.channel = channel
        self.probes = probes
        self.served: dict[str, Served] = {}
        self.probed: set[str] = set()
        self._refused = Throttled(log)  # a node queue of someone else's: said every sync

    def offers(self) -> dict[str, NodeOffer]:
        found = self.node.backend.offers()
        return {self.node.id: local_offer(self.node.settings)} if found is None else dict(found)

    def owner(self, node_id: str) -> UUID:
        local = self.node.backend.offers() is None
        return self.node.boot_id if local else cluster_owner(node_id)

    async def sync(self) -> None:
        """Serve what the backend offers now: join new nodes, refresh changed ones, and stop
        consuming for the nodes that went away or are not ready."""
        node, store = self.node, self.node.store
        known = self.offers()
        for node_id in set(known) - self.probed:
            await self.probes.bind(PROBE_EXCHANGE, node_id)
            self.probed.add(node_id)
        for node_id in self.probed - set(known):
            with contextlib.suppress(*TRANSIENT):
                await self.probes.unbind(PROBE_EXCHANGE, node_id)
            self.probed.discard(node_id)
        offers = {k: o for k, o in known.items() if o.ready}
        for node_id in list(self.served):
            if node_id not in offers or offers[node_id] != self.served[node_id].offer:
                await self._leave(node_id, ready=node_id in offers)
        for node_id, offer in offers.items():
            if node_id in self.served or await self._unusable(node_id):
                continue
            owner = self.owner(node_id)
            # the queue first: registering wakes the schedulers (NOTIFY sked_node), and a
            # dispatch published before the queue is bound would come back unroutable
            queue = await node.bus.declare_node_queue(self.channel, node_id)
            await store.nodes.register(
                offer.id,
                offer.slots,
                offer.cpu,
                offer.memory_mb,
                offer.gpu,
                offer.labels,
                owner,
                self._advertised(offer),
            )
            # RabbitMQ hands the next consumer no more than the node may hold
            await self.channel.set_qos(prefetch_count=prefetch_count(offer.slots + offer.prefetch))
            tag = await queue.consume(node.receive)
            self.served[node_id] = Served(offer, owner, queue, tag)
            node.serves.add(node_id)
            log.info("serving node %s (%d slots)", node_id, offer.slots)

    async def reassert(self) -> None:
        """Each served node's queue, sked.dispatch and the binding between them, declared
        again (the nodes loop calls this every few heartbeats): deleted or unbound under a
        running executor, they come back; a queue someone declared again with other
        arguments cannot be consumed, and its node is left, not ready, until it is sked's.
        Likewise sked.probe and this executor's probe bindings: without them the monitor's
        loss ladder finds a live node unreachable and skips its grace. Best effort: with
        RabbitMQ away it waits for a later heartbeat (a channel asked of a dropped connection
        is refused as AmqpAway, transient), and the node's heartbeats to Postgres go on
        meanwhile."""
        try:
            async with asyncio.timeout(REASSERT_S):  # a silent link answers no declaration
                await self._reassert()
        except TRANSIENT as exc:
            log.info("nodes' queues not declared again now (RabbitMQ away?): %s", exc)

    async def _reassert(self) -> None:
        for node_id in list(self.served):
            if await self._unusable(node_id):
                await self._leave(node_id)
        # declared on a channel of its own: a refusal (someone made it another type) closes
        # the channel it is made on, and this one's consumers are the nodes'
        try:
            async with await self.node.bus.consumer_channel(1) as channel:
                await channel.declare_exchange(PROBE_EXCHANGE, ExchangeType.DIRECT, durable=True)
        except aiormq.exceptions.ChannelPreconditionFailed as exc:  # it is there: bind to it
            self._refused.warning("exchange %s is not sked's (direct): %s", PROBE_EXCHANGE, exc)
        for node_id in self.probed:
            await self.probes.bind(PROBE_EXCHANGE, node_id)

    async def _unusable(self, node_id: str) -> bool:
        problem = await self.node.bus.node_queue_problem(node_id)
        if problem is not None:
            self._refused.warning("node %s not served: %s", node_id, problem)
        return problem is not None

    async def _leave(self, node_id: str, ready: bool = False, stopping: bool = False) -> None:
        served = self.served.pop(node_id)
        self.node.serves.discard(node_id)
        nodes = self.node.store.nodes
        with contextlib.suppress(*TRANSIENT):
            if stopping:
                await nodes.leave(node_id, served.owner)
            else:
                await nodes.set_ready(node_id, served.owner, ready)
            await served.queue.cancel(served.tag)
        if not ready:
            log.info("node %s is no longer served (gone, cordoned or not ready)", node_id)

    def _advertised(self, offer: NodeOffer) -> int:
        """The backlog a node's row offers placement: a local node's as its attempts have
        earned (shared/backlog.py), a cluster node's as offered."""
        return self.node.backlog.advertised if self.node.gated else offer.prefetch

    async def advertise(self) -> None:
        """Write the local node's backlog now: it changed."""
        node = self.node
        served = self.served.get(node.id)
        if node.gated and served is not None:
            await node.store.nodes.set_prefetch(node.id, served.owner, node.backlog.advertised)

    async def beat(self) -> bool:
        """Refresh every served node's row; False when a local node was taken over by another
        executor."""
        node = self.node
        for node_id, served in list(self.served.items()):
            slots = served.offer.slots
            load = sum(1 for t in node.active.values() if t.task.node == node_id) / slots
            prefetch = self._advertised(served.offer)
            if not await node.store.nodes.heartbeat(node_id, served.owner, load, prefetch):
                mine = served.owner == node.boot_id
                if mine and await node.store.nodes.owner(node_id) is not None:
                    return False  # another executor took this node id over
                # re-registered under another owner, or forgotten (gone so long, cut off from
                # Postgres, that recovery deleted its row): the next sync serves it anew
                await self._leave(node_id)
        return True

    async def leave_all(self) -> None:
        """This executor stops: its nodes left cleanly (the healthy-nodes trigger of degrade
        does not count them as lost)."""
        for node_id in list(self.served):
            await self._leave(node_id, stopping=True)
