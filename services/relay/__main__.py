"""Wire settings -> Postgres pool, AMQP bus -> Relay, and run it: `sked service relay`."""

from __future__ import annotations

import sys

from services.relay.service import Relay
from shared.bus import AmqpBus
from shared.repo import create_pool
from shared.runtime import configure_logging, run_main, serve
from shared.settings import Settings


async def main(settings: Settings) -> None:
    pool = await create_pool(settings.database_url, settings.db_pool_size)
    bus = AmqpBus(settings.rabbitmq_url)
    try:
        await bus.connect()
        await serve(Relay(settings, pool, bus))
    finally:
        await bus.close()
        await pool.close()


def run() -> int:
    settings = Settings()
    configure_logging(settings, "relay")
    return run_main(lambda: main(settings))


if __name__ == "__main__":
    sys.exit(run())
