"""An executor whose open Postgres connections go silent at once (a NAT or stateful firewall
that lost its state, a failover of the address: no FIN, no RST), while new connections work.

Found by a Jepsen-style nemesis (faults combined while a workload ran): an executor's finish
loop hung on such a connection, so attempts whose processes had ended stayed Running 30 s,
outcomes unwritten, leases renewed; in one schedule the stale node rows tipped the degrade
evaluator into FULL mode ("1 of 3 nodes healthy") and held 14 tasks in Ready for 45 s.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from uuid import UUID

import asyncpg

from shared.client import SkedClient
from shared.errors import NotFound
from shared.fsm import State
from tests.faults.conftest import Deployment
from tests.faults.jobs import FAST, shell_stamp
from tests.faults.proxy import Proxy


class StrandingProxy(Proxy):
    """A Proxy that can also `strand()` the connections open now: from then on they carry
    nothing either way and are never closed (a NAT or stateful firewall that lost its state,
    a failover of the address: no FIN, no RST), while new connections pass as before."""

    def __init__(self, target_port: int) -> None:
        super().__init__(target_port)
        self.epoch = 0
        self._released = asyncio.Event()

    def strand(self) -> None:
        self.epoch += 1

    async def close(self) -> None:
        self._released.set()
        await super().close()

    def _opened(self) -> object:
        return self.epoch

    async def _pump(
        self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, epoch: object = None
    ) -> None:
        while data := await src.read(65536):
            if epoch != self.epoch:
                await self._released.wait()  # swallowed: the connection went silent
                return
            dst.write(data)
            await dst.drain()


async def _running(client: SkedClient, task_id: UUID) -> bool:
    try:
        return (await client.get(task_id)).status is State.RUNNING
    except NotFound:  # not admitted yet
        return False


async def test_a_pooled_connection_gone_silent_is_dropped_and_the_node_beats_on(
    deployment: Deployment,
    client: SkedClient,
    pool: asyncpg.Pool,
    stamps: Path,
    service_env: dict[str, str],
) -> None:
    """One executor reaches Postgres through a link whose open connections go silent at once,
    while new connections work. Its lease renewals always rode it out (store.LeaseLink drops
    a silent connection and connects afresh), but its node heartbeat and its outcomes run on
    its pool, whose statements waited out asyncpg's command_timeout (60 s), and then the
    cancel asyncpg sends was waited for on the same silent connection before the pool took it
    back: the node's row was not refreshed for about a minute, so the node was gone
    (SKED_NODE_TTL_S, 10 s) to placement, SkedNodeLost fired, the degrade evaluator counted
    it unhealthy, a task submitted meanwhile waited in Ready beside an idle, healthy executor,
    and an attempt ending meanwhile stayed Running. Now each statement on the executor's
    pool is bounded by half the node TTL (wiring.node_statement_s), and one that overruns
    has its connection dropped, not given back, and the pool's others replaced
    (db.pooled): the heartbeat is retried at once on a fresh connection and lands within the
    TTL, the outcome of the attempt that ended meanwhile is written, and the task submitted
    later runs on the node."""
    for name in ("scheduler", "relay", "recovery"):
        await deployment.start(name, env=FAST)
    await deployment.start("heartbeat-monitor", "--port", "0", env=FAST, ready="listening on")
    pg = StrandingProxy(5432)
    await pg.start()
    try:
        env = {**FAST, "SKED_DATABASE_URL": pg.url(service_env["SKED_DATABASE_URL"])}
        await deployment.executor("a", 2, env=env)
        warm = await client.submit(
            {"name": "warm", "job": {"kind": "command", "argv": shell_stamp(stamps, 0.2)}}
        )
        await client.wait(warm, timeout=30)
        during = await client.submit(
            {"name": "during", "job": {"kind": "command", "argv": shell_stamp(stamps, 1.5)}}
        )
        began = time.monotonic()
        while not await _running(client, during):
            assert time.monotonic() < began + 30, "the task 'during' never ran"
            await asyncio.sleep(0.05)
        pg.strand()  # 'during' ends about 1.5 s from now: its outcome goes to the pool
        stranded_at = time.monotonic()
        task: UUID | None = None
        worst = 0.0
        while time.monotonic() < stranded_at + 22:
            if task is None and time.monotonic() > stranded_at + 11:
                task = await client.submit(
                    {"name": "after", "job": {"kind": "command", "argv": shell_stamp(stamps, 0.2)}}
                )
            age = await pool.fetchval(
                "SELECT extract(epoch FROM now() - heartbeat_at)::float FROM nodes WHERE id = 'a'"
            )
            worst = max(worst, age)
            await asyncio.sleep(0.25)
        assert task is not None
        got, ended = await client.get(task), await client.get(during)
        said = (
            f"node a's heartbeat was {worst:.1f} s old (its TTL is 10 s) after its pooled "
            f"connections went silent; the attempt that ended 1.5 s after is "
            f"{ended.status.value} 22 s after ({ended.status_reason}); a task submitted 11 s "
            f"after, onto the idle executor, is {got.status.value} 11 s later "
            f"({got.status_reason})"
        )
        assert worst < 10.0, said
        assert ended.status is State.SUCCESS, said
        assert ended.attempt == 1, said
        assert got.status is State.SUCCESS, said
    finally:
        await pg.close()
