"""End-to-end fixtures: a whole deployment of sked services as separate processes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from shared.client import SkedClient
from shared.settings import Settings
from tests.helpers import ServiceProcess


class Deployment:
    """Starts services as processes against one test's database, vhost and Redis database."""

    def __init__(self, env: dict[str, str], log_dir: Path) -> None:
        self.env = env
        self.log_dir = log_dir
        self.procs: list[ServiceProcess] = []

    async def start(
        self, name: str, *args: str, env: dict[str, str] | None = None, ready: str | None = None
    ) -> ServiceProcess:
        proc = ServiceProcess(name, {**self.env, **(env or {})}, self.log_dir, *args)
        self.procs.append(proc)
        await proc.wait_for_log(ready or _READY[name], timeout=60)
        return proc

    async def executor(
        self, node_id: str, slots: int = 4, *args: str, env: dict[str, str] | None = None
    ) -> ServiceProcess:
        # a state directory of its own: the default (<tmp>/sked/<node>) is shared per machine
        state = self.log_dir / f"state-{node_id}-{len(self.procs)}"
        return await self.start(
            "executor",
            "--node-id",
            node_id,
            "--slots",
            str(slots),
            *args,
            env={"SKED_STATE_DIR": str(state), **(env or {})},
            ready=f"executor {node_id} ready",
        )

    def stop_all(self) -> dict[str, int]:
        """Stop every process; the exit codes of those not killed on purpose."""
        codes = {p.log_path.name: p.stop() for p in self.procs}
        return {
            name: c for p, (name, c) in zip(self.procs, codes.items(), strict=True) if not p.killed
        }

    def logs(self) -> str:
        return "\n".join(f"===== {p.log_path.name}\n{p.log()}" for p in self.procs)


_READY = {
    "scheduler": "scheduler consuming",
    "relay": "relay listening",
    "executor": "ready:",
    "recovery": "recovery running",
    "heartbeat-monitor": "listening on",
}


@pytest.fixture
async def deployment(
    service_env: dict[str, str], tmp_path: Path, request: pytest.FixtureRequest
) -> AsyncIterator[Deployment]:
    d = Deployment(service_env, tmp_path)
    yield d
    codes = d.stop_all()
    failed = request.node.rep_call.failed if hasattr(request.node, "rep_call") else False
    if failed or any(c not in (0, None) for c in codes.values()):
        print(d.logs())  # noqa: T201 - shown by pytest only for a failed test
    assert all(c == 0 for c in codes.values()), f"a service did not exit cleanly: {codes}"


@pytest.fixture
async def client(settings: Settings) -> AsyncIterator[SkedClient]:
    c = SkedClient(settings)
    yield c
    await c.close()
