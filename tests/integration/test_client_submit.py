"""The SDK refuses at the caller what intake would dead-letter: a spec holding what Postgres
cannot store, or too large for a message, raises InvalidSpec and sends nothing, rather than
handing back the id of a task that will never exist. (tests/e2e/test_hostile.py has intake
admit a spec at the limit.)"""

from __future__ import annotations

import aio_pika
import pytest

from shared.bus import SUBMIT_QUEUE
from shared.client import SkedClient
from shared.errors import InvalidSpec
from shared.settings import Settings


def command(name: str, *argv: str) -> dict[str, object]:
    return {"name": name, "job": {"kind": "command", "argv": list(argv)}}


async def test_a_spec_postgres_cannot_store_is_refused_and_nothing_is_sent(
    settings: Settings,
) -> None:
    handler = {"kind": "handler", "handler": "tests.handlers:echo", "args": {"k\x00": 1}}
    async with SkedClient(settings) as client:
        for bad, where in (
            (command("nul\x00", "true"), "name holds a NUL"),
            (command("argv", "tr\x00ue"), r"job.argv\[0\] holds a NUL"),
            (command("surrogate", "\ud800"), "surrogate"),
            ({"name": "args", "job": handler}, "a key in job.args holds a NUL"),
            # over the message size in arguments each under what execve() takes per string
            (command("big", "echo", *["x" * 100_000] * 11), "SKED_MAX_MESSAGE_BYTES"),
        ):
            with pytest.raises(InvalidSpec, match=where):
                await client.submit(bad)
            with pytest.raises(InvalidSpec, match=where):  # a batch: none of it goes
                await client.submit_many([command("fine", "true"), bad])
        workflow = {"name": "w", "tasks": [{"name": "a", "command": ["echo", "\x00"]}]}
        with pytest.raises(InvalidSpec, match="NUL"):
            await client.submit_workflow(workflow)
        await client.submit(command("fine", "true"))  # the one message sent
    connection = await aio_pika.connect(settings.rabbitmq_url)
    async with connection:
        channel = await connection.channel()
        queue = await channel.declare_queue(SUBMIT_QUEUE, passive=True)
        assert queue.declaration_result.message_count == 1
