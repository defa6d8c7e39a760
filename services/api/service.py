"""The API service: an aiohttp server on the service's own Postgres pool, Redis and RabbitMQ
connections. It has no loops of its own: it answers requests until stopped."""

from __future__ import annotations

from collections.abc import Sequence

from aiohttp import web

from services.api.app import make_app
from shared.client import SkedClient
from shared.service import Loop, Service
from shared.wiring import Backends


class BorrowedClient(SkedClient):
    """The SDK's calls on the service's connections (one path for submit, control, reads and
    live logs); close() leaves the connections to the service that owns them."""

    def __init__(self, b: Backends) -> None:
        super().__init__(b.settings)
        self._store, self._bus, self._redis = b.store, b.bus, b.redis

    async def close(self) -> None:
        self._store = self._bus = self._redis = None


class Api(Service):
    name = "api"

    def __init__(self, b: Backends) -> None:
        super().__init__(b.settings, b.store)
        self.client = BorrowedClient(b)
        self.port = b.settings.api_port
        self._runner: web.AppRunner | None = None

    def loops(self) -> Sequence[Loop]:
        return []

    async def setup(self) -> None:
        app = make_app(self.settings, self.store, self.client)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.settings.api_host, self.settings.api_port)
        await site.start()
        if self._runner.addresses:  # the port actually bound, when 0 asked for any free one
            self.port = self._runner.addresses[0][1]

    def announce(self) -> str:
        return f"api listening on http://{self.settings.api_host}:{self.port}/v1"

    async def teardown(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        await self.client.close()
