"""An adversarial review of the fourteenth session's own code (fef99f9..1a2848c: the log bound,
a handler's fork, held dispatches let go, AmqpAway, the renewal's timeout, the monitor's stall
rule). Each case failed on that code: the docstrings say what happened; each test shows it no
longer does. Held up: a multiprocessing fork Pool in a handler; the log bound against a
symlink, FIFO, directory or socket at the log path; the stall rule against Postgres slow for
good; drop_moved_on, gather and claimable against re-placed attempts and shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from pathlib import Path
from typing import Any
from uuid import uuid4

from services.executor.backends import Launch
from services.executor.backends.local import LocalBackend
from shared.settings import Settings
from tests.faults.proxy import Proxy
from tests.helpers import eventually
from tests.integration.pipeline import services

# --- a proxy whose established connections can be black-holed, new ones flowing ------------


class BlackHole(Proxy):
    """`swallow(port)`: the connection from that client port goes silent for good (bytes
    neither way, no reset: a NAT/conntrack entry lost, a firewall's state dropped); every
    other connection, and those made later, flow normally. `release()` resets the swallowed."""

    def __init__(self, target_port: int) -> None:
        super().__init__(target_port)
        self.dead: set[int] = set()  # client ports swallowed
        self._by_port: dict[int, list[asyncio.StreamWriter]] = {}
        self._released = asyncio.Event()

    def swallow(self, port: int) -> None:
        self.dead.add(port)

    def release(self) -> None:
        self._released.set()
        for port in self.dead:
            for w in self._by_port.get(port, []):
                with contextlib.suppress(Exception):
                    w.transport.abort()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        port = writer.get_extra_info("peername")[1]
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self._by_port[port] = [writer, up_writer]
        self._conns |= {writer, up_writer}
        pipes = [
            asyncio.create_task(self._pipe(port, reader, up_writer)),
            asyncio.create_task(self._pipe(port, up_reader, writer)),
        ]
        try:
            await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in pipes:
                t.cancel()
        for w in (writer, up_writer):
            self._conns.discard(w)
            w.transport.abort()

    async def _pipe(self, port: int, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        while data := await src.read(65536):
            if port in self.dead:
                await self._released.wait()  # swallowed until the test lets go
                return
            dst.write(data)
            await dst.drain()
        dst.transport.abort()


def lease_port(executor: Any) -> int:
    conn = executor.watcher._leases._conn
    assert conn is not None, "no lease link yet"
    return int(conn._transport.get_extra_info("sockname")[1])


async def test_a_renewal_hung_on_a_black_holed_connection_gives_up_within_a_period(
    settings: Settings, tmp_path: Path
) -> None:
    """An executor runs a 40 s command (heartbeat timeout 20 s, renewed every 2 s); right
    after a renewal, the lease link's TCP connection is black-holed (no reset, as when a NAT
    or firewall drops its state); any new connection to Postgres works. Should: the renewal
    gives up within about a renewal period, the next connects afresh, the lease is renewed a
    few seconds later and the attempt never freezes. b3bd403 had bounded every renewal by
    what is left of the lease (~16 s), for a slow link's reconnection: it hung on the dead
    connection that long, and no renewal succeeded for the rest of the lease although
    Postgres was reachable the whole time. Now only a renewal that connects afresh has that
    bound; one on a connection made before has half of it, so a fresh one still fits."""
    proxy = BlackHole(5432)
    await proxy.start()
    try:
        url = proxy.url(settings.database_url)
        async with services(settings, tmp_path, "bh", database_url=url) as running:
            node = running.executor.node
            tid = await running.client.submit(
                {
                    "name": "bh",
                    "job": {"kind": "command", "argv": ["sleep", "40"]},
                    "heartbeat_timeout_s": 20,
                }
            )

            async def renewed_since(at: float) -> bool:
                return any(a.renewed_at > at for a in node.active.values())

            await eventually(lambda: renewed_since(0.0), timeout=30, interval=0.05, what="run")
            first = next(iter(node.active.values())).renewed_at
            # a renewal just went through
            await eventually(lambda: renewed_since(first), timeout=10, interval=0.02, what="renew")
            await asyncio.sleep(0.2)
            cut = time.monotonic()
            proxy.swallow(lease_port(running.executor))
            key = next(iter(node.active))
            frozen_at = None
            renewed_after = None
            while time.monotonic() - cut < 24:
                a = node.active.get(key)
                if a is not None and a.renewed_at > cut:
                    renewed_after = a.renewed_at - cut
                    break
                if frozen_at is None and node.backend.frozen(key):
                    frozen_at = time.monotonic() - cut
                await asyncio.sleep(0.1)
            proxy.release()
            del tid
    finally:
        proxy.release()
        await proxy.close()
    assert renewed_after is not None, f"no renewal within 24 s (frozen at {frozen_at} s)"
    assert renewed_after < 15, (  # of a 20 s lease: in time, with a fresh connection to spare
        f"after the lease link was black-holed, the next successful renewal came "
        f"{renewed_after} s later (frozen at {frozen_at} s); Postgres was reachable throughout"
    )
    assert frozen_at is None, f"the attempt was frozen {frozen_at} s after the black hole"


# --- RabbitMQ silently partitioned: does the nodes loop keep beating to Postgres? --------------


async def test_a_silent_rabbitmq_partition_does_not_stop_the_node_s_postgres_heartbeats(
    settings: Settings, tmp_path: Path
) -> None:
    """An executor (node heartbeat 0.3 s: the queues are declared again every 1.5 s) loses
    RabbitMQ to a silent partition (Proxy.cut: packets swallowed, no reset); Postgres is fine.
    Should (Serving.reassert's docstring): the declarations wait for a later heartbeat and
    "the node's heartbeats to Postgres go on meanwhile". The nodes loop awaited a channel's
    opening with no timeout (Serving.reassert -> node_queue_problem -> AmqpBus.open_channel),
    stuck there for the whole cut: the node's heartbeat_at stopped moving, and after
    SKED_NODE_TTL_S the node counted as gone (SkedNodeLost fired, degrade mode went to full)
    though it ran its attempts fine. Now a channel's opening and a reassert are bounded, and
    the reassert comes after the node's heartbeat."""
    proxy = await Proxy(5672).start()
    try:
        url = proxy.url(settings.rabbitmq_url)
        async with services(
            settings, tmp_path, "rp", rabbitmq_url=url, node_heartbeat_s=0.3
        ) as running:
            pool = running.store.pool
            await asyncio.sleep(1.0)
            proxy.cut()
            cut = time.monotonic()
            beats: list[float] = []
            while time.monotonic() - cut < 15:
                at = await pool.fetchval(
                    "SELECT extract(epoch FROM now() - heartbeat_at) FROM nodes WHERE id = 'rp'"
                )
                beats.append(float(at))
                await asyncio.sleep(0.5)
            proxy.heal()
    finally:
        await proxy.close()
    assert max(beats) < 5, (
        f"while RabbitMQ was silently cut off, node rp's Postgres heartbeat aged to "
        f"{max(beats):.1f} s (node_ttl_s {settings.node_ttl_s}); ages: {beats}"
    )


# --- handlers that fork legitimately -----------------------------------------------------------

HERE = "tests.integration.test_review2_hostile"


def _square(x: int) -> int:
    return x * x


def mp_pool() -> int:
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(2) as pool:
        return sum(pool.map(_square, range(10)))


def fork_child_exits() -> int:
    pid = os.fork()
    if pid == 0:
        import sys

        sys.exit(3)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def fork_child_raises() -> int:
    pid = os.fork()
    if pid == 0:
        raise ValueError("child")
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def quick() -> int:
    return 7


async def test_a_handler_s_forked_child_s_exit_status_reaches_its_parent(tmp_path: Path) -> None:
    """A handler forks; the child ends with sys.exit(3) (or raises ValueError); the parent
    waits for it and returns its exit code, as a fork-and-wait handler checks its child's
    work. Should: the parent sees 3 (and 1 for the uncaught exception), as Python gives
    anywhere else. It saw 0 for both: Worker._call caught the child's SystemExit (and any
    exception) as the job's failure, then the fork check of 1a29d4d ended the child with
    os._exit(0). Now the child ends with the status its code meant (Worker._forked)."""
    from shared.models import HandlerJob

    b = LocalBackend(1, tmp_path / "state", warm_workers=1)
    await b.start()
    try:
        outs = {}
        for name in ["quick", "mp_pool", "fork_child_exits", "fork_child_raises", "quick"]:
            launch = Launch(uuid4(), 1, HandlerJob(handler=f"{HERE}:{name}"), None)
            async with asyncio.timeout(30):
                outs[name] = await b.run(launch)
    finally:
        await b.close()
    bad = {k: o for k, o in outs.items() if not o.ok}
    assert not bad, bad
    results = {k: o.result for k, o in outs.items()}
    assert results["mp_pool"] == 285, results
    assert (results["fork_child_exits"], results["fork_child_raises"]) == (3, 1), (
        f"a forked child's sys.exit(3) / uncaught exception reached its parent as "
        f"{results['fork_child_exits']} / {results['fork_child_raises']}"
    )
