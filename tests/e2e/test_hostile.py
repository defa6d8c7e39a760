"""Hostile input and output, end to end, with every service a process of its own.

Input: each poison class is published raw, in one batch with valid submissions; every valid
task runs, every poison message is in `sked.dead` with its reason, and no service process
restarts. The same for the executor's dispatch queue, heartbeats over RabbitMQ and probes.
Output: NUL bytes and invalid UTF-8 in a log, NaN and 20 MB results — each task terminal with
a clear result or error, the executor up and running the next task. Secrets: what a task sees
of its environment.
"""

from __future__ import annotations

import json
import subprocess
from typing import Any
from uuid import uuid4

import aio_pika
import asyncpg
import pytest

from shared.bus import (
    BATCH_KEY,
    DEAD_QUEUE,
    DISPATCH_EXCHANGE,
    HEARTBEATS_EXCHANGE,
    PROBE_EXCHANGE,
    REASON_HEADER,
    SUBMIT_KEY,
    TASKS_EXCHANGE,
    WORKFLOW_KEY,
)
from shared.client import SkedClient
from shared.errors import InvalidSpec
from shared.fsm import State
from shared.models import TaskSpec
from shared.rendering import ENVELOPE_BYTES
from shared.settings import Settings
from tests.e2e.checks import check_all_histories
from tests.e2e.conftest import Deployment
from tests.helpers import SKED, eventually

VALID = {
    "name": "valid",
    "job": {"kind": "handler", "handler": "tests.e2e.jobs:add", "args": [1, 2]},
}
KEYED = {**VALID, "name": "keyed", "idempotency_key": "one-key"}
TAKEN = {**VALID, "name": "owner", "idempotency_key": "taken-key"}


def spec_with_args(args: str) -> bytes:
    return (
        b'{"name": "p", "job": {"kind": "handler", "handler": "tests.e2e.jobs:echo", '
        b'"args": ' + args.encode() + b"}}"
    )


def workflow(tasks: list[dict[str, Any]]) -> bytes:
    return json.dumps({"name": "wf", "tasks": tasks}).encode()


# body, routing key, headers, the words the dead-letter reason must hold
POISON: dict[str, tuple[bytes, str, dict[str, Any], str]] = {
    "deep nesting": (b"[" * 300_000 + b"]" * 300_000, SUBMIT_KEY, {}, "nested deeper"),
    "deep args": (spec_with_args("[" * 500 + "]" * 500), SUBMIT_KEY, {}, "nested deeper"),
    "5,000-digit integer": (spec_with_args("9" * 5000), SUBMIT_KEY, {}, "malformed JSON"),
    "NUL in a string": (spec_with_args('"a\\u0000b"'), SUBMIT_KEY, {}, "NUL character"),
    "lone surrogate": (spec_with_args('"\\udfff"'), SUBMIT_KEY, {}, "lone surrogate"),
    "NaN": (spec_with_args("NaN"), SUBMIT_KEY, {}, "NaN is not a JSON number"),
    "malformed": (b"{nope", SUBMIT_KEY, {}, "malformed JSON"),
    "terminal escapes": (b"\x1b]0;owned\x07\x1b[2J", SUBMIT_KEY, {}, "malformed JSON"),
    "not an object": (b"[1, 2]", SUBMIT_KEY, {}, "must be a JSON object"),
    "unknown field": (
        json.dumps({**VALID, "surprise": 1}).encode(),
        SUBMIT_KEY,
        {},
        "surprise: Extra inputs",
    ),
    "a key reused with another spec": (
        json.dumps({**KEYED, "max_retries": 3}).encode(),
        SUBMIT_KEY,
        {},
        "idempotency key 'one-key' already names task",
    ),
    "workflow tasks colliding on a key": (
        workflow(
            [
                {"name": "a", "command": ["true"], "idempotency_key": "k"},
                {"name": "b", "command": ["true"], "idempotency_key": "k"},
            ]
        ),
        WORKFLOW_KEY,
        {},
        "share the idempotency key 'k'",
    ),
    "workflow task with a key another task holds": (
        workflow([{"name": "a", "command": ["true"], "idempotency_key": "taken-key"}]),
        WORKFLOW_KEY,
        {},
        "idempotency key 'taken-key' already names task",
    ),
    "deep workflow": (b'{"name": "w", "tasks": ' + b"[" * 200_000, WORKFLOW_KEY, {}, "JSON"),
    "a batch without tasks": (b'{"tasks": "x"}', BATCH_KEY, {}, 'non-empty list "tasks"'),
    "a batch of garbage": (b'{"tasks": [1, {nope', BATCH_KEY, {}, "malformed JSON"),
}
# a batch message (the SDK's submit_many) with one bad task: that task alone is dead-lettered,
# as its own spec, the others run
BAD_IN_BATCH = {**VALID, "name": "bad in a batch", "surprise": 1}


async def publish(
    channel: aio_pika.abc.AbstractChannel,
    exchange: str,
    key: str,
    body: bytes,
    headers: dict[str, Any] | None = None,
    message_id: str | None = None,
) -> None:
    target = await channel.get_exchange(exchange)
    await target.publish(
        aio_pika.Message(
            body, content_type="application/json", headers=headers or {}, message_id=message_id
        ),
        routing_key=key,
    )


async def dead_letters(channel: aio_pika.abc.AbstractChannel, n: int) -> dict[bytes, str]:
    """The next `n` messages of `sked.dead`: {body: reason}."""
    dead = await channel.get_queue(DEAD_QUEUE)
    out: dict[bytes, str] = {}

    async def one_more() -> bool:
        message = await dead.get(fail=False)  # None while the queue is empty
        if message is not None:
            out[message.body] = str((message.headers or {}).get(REASON_HEADER))
            await message.ack()
        return len(out) >= n

    await eventually(one_more, timeout=30, interval=0.02, what=f"{n} dead letters")
    return out


def parsed(body: bytes) -> object:
    """A dead letter's JSON, or None for the poison that is not JSON at all."""
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        return None


def never_restarted(deployment: Deployment) -> None:
    for proc in deployment.procs:
        assert proc.proc.poll() is None, f"{proc.name} exited:\n{proc.log()}"
        assert "service failed" not in proc.log(), proc.log()


async def test_poison_submissions_in_one_batch_with_valid_ones(
    deployment: Deployment, client: SkedClient, settings: Settings, pool: asyncpg.Pool
) -> None:
    owner = await client.submit(TAKEN)  # a standalone task holding "taken-key"
    connection = await aio_pika.connect_robust(settings.rabbitmq_url)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        valid_ids = [str(uuid4()) for _ in range(5)]
        # one idempotency key twice in the batch, the same spec: one task (and below, the
        # same key with another spec: refused)
        keyed = [str(uuid4()), str(uuid4())]
        for mid in keyed:
            await publish(
                channel, TASKS_EXCHANGE, SUBMIT_KEY, json.dumps(KEYED).encode(), message_id=mid
            )
        # published before any scheduler runs: the first intake batch holds them all
        for i, mid in enumerate(valid_ids):
            await publish(
                channel, TASKS_EXCHANGE, SUBMIT_KEY, json.dumps(VALID).encode(), message_id=mid
            )
            if i == 1:
                for body, key, headers, _ in POISON.values():
                    await publish(channel, TASKS_EXCHANGE, key, body, headers)
        batched = [str(uuid4()), str(uuid4())]
        entries = [
            {"id": batched[0], "spec": VALID},
            {"id": str(uuid4()), "spec": BAD_IN_BATCH},
            {"id": batched[1], "spec": VALID},
        ]
        await publish(channel, TASKS_EXCHANGE, BATCH_KEY, json.dumps({"tasks": entries}).encode())
        # a valid task with headers of unexpected types: they count as absent, it runs
        odd = str(uuid4())
        await publish(
            channel,
            TASKS_EXCHANGE,
            SUBMIT_KEY,
            json.dumps(VALID).encode(),
            {"traceparent": 12345, "x-table": {"a": [1, "s"], "b": 1.5}},
            odd,
        )
        odd_bytes = str(uuid4())
        await publish(
            channel,
            TASKS_EXCHANGE,
            SUBMIT_KEY,
            json.dumps(VALID).encode(),
            {"traceparent": bytearray(b"\xff\xfe")},
            odd_bytes,
        )
        scheduler = await deployment.start("scheduler")
        await deployment.start("relay")
        await deployment.executor("h1", 4)
        await deployment.start("heartbeat-monitor", "--port", "0")
        ids = [*valid_ids, odd, odd_bytes, *batched]
        done = await client.wait_all([*ids, owner], timeout=60)
        assert all(t.status is State.SUCCESS for t in done.values()), done
        assert all(t.result == 3 for t in done.values())
        keyed_tasks = await pool.fetch("SELECT id FROM tasks WHERE idempotency_key = 'one-key'")
        assert len(keyed_tasks) == 1
        assert (await client.wait(keyed_tasks[0]["id"], timeout=30)).status is State.SUCCESS

        # an operator reads them, left in place, oldest first; printed inert
        def sked_dead(*args: str) -> subprocess.CompletedProcess[str]:
            argv = [SKED, "dead", "--limit", "1000", *args]
            return subprocess.run(argv, env=deployment.env, capture_output=True, text=True)

        async def all_dead() -> bool:
            out = sked_dead("--json")
            assert out.returncode == 0, out.stderr
            return len(json.loads(out.stdout)) == len(POISON) + 1

        await eventually(all_dead, timeout=30, what="sked dead to list every poison")
        listed = json.loads(sked_dead("--json").stdout)
        assert "\x1b]0;owned\x07\x1b[2J" in [d["body"] for d in listed]
        assert {d["routing_key"] for d in listed} == {SUBMIT_KEY, WORKFLOW_KEY, BATCH_KEY}
        shown = sked_dead()
        assert shown.returncode == 0, shown.stderr
        assert "\x1b" not in shown.stdout
        assert "\\x1b]0;owned\\x07" in shown.stdout
        reasons = await dead_letters(channel, len(POISON) + 1)
        for name, (body, _, _, why) in POISON.items():
            assert body in reasons, f"{name} was not dead-lettered"
            assert why in reasons[body], f"{name}: {reasons[body]!r}"
        alone = [why for body, why in reasons.items() if parsed(body) == BAD_IN_BATCH]
        assert len(alone) == 1, reasons
        assert alone[0].startswith("task 1 of a batch: invalid task spec: surprise: Extra"), alone
        assert await (await channel.get_queue(DEAD_QUEUE)).get(fail=False) is None
        assert "scheduler consuming" in scheduler.log()
        never_restarted(deployment)
    await check_all_histories(pool)


async def test_poison_on_the_dispatch_heartbeat_and_probe_queues(
    deployment: Deployment, client: SkedClient, settings: Settings
) -> None:
    await deployment.start("scheduler")
    await deployment.start("relay")
    await deployment.start("heartbeat-monitor", "--port", "0")
    await deployment.executor("n1", 2)
    dispatch = {
        "task_id": str(uuid4()),
        "attempt": 1,
        "version": 4,
        "retry_count": 0,
        "max_retries": 0,
        "node": "n1",
    }
    node = {"id": "n1", "boot_id": str(uuid4()), "load": 0.0}
    beat = {"task_id": str(uuid4()), "attempt": 1, "seq": 1, "token": "0" * 64}
    poison = [
        (DISPATCH_EXCHANGE, "n1", b"{not json", "unreadable dispatch"),
        (
            DISPATCH_EXCHANGE,
            "n1",
            json.dumps({**dispatch, "attempt": 10**30}).encode(),
            "unreadable dispatch",
        ),
        (
            DISPATCH_EXCHANGE,
            "n1",
            json.dumps({**dispatch, "version": -1}).encode(),
            "unreadable dispatch",
        ),
        (
            DISPATCH_EXCHANGE,
            "n1",
            json.dumps({**dispatch, "node": "elsewhere"}).encode(),
            "a dispatch for node 'elsewhere'",
        ),
        (HEARTBEATS_EXCHANGE, "", b"\xff\xfe", "unreadable heartbeat message"),
        (
            HEARTBEATS_EXCHANGE,
            "",
            json.dumps({"node": node, "beats": [{**beat, "attempt": 2**40}]}).encode(),
            "unreadable heartbeat message",
        ),
        (
            HEARTBEATS_EXCHANGE,
            "",
            json.dumps({"node": node, "beats": [{**beat, "seq": 10**30}]}).encode(),
            "unreadable heartbeat message",
        ),
        (
            HEARTBEATS_EXCHANGE,
            "",
            json.dumps({"node": {**node, "load": "NaN"}, "beats": []}).encode(),
            "unreadable heartbeat message",
        ),
        (  # a beat over the bus carries its attempt's token
            HEARTBEATS_EXCHANGE,
            "",
            json.dumps({"node": node, "beats": [{**beat, "token": None}]}).encode(),
            "unreadable heartbeat message",
        ),
        (PROBE_EXCHANGE, "n1", b"[" * 100_000, "unreadable probe"),
        (
            PROBE_EXCHANGE,
            "n1",
            json.dumps({"task_id": "x", "attempt": 1}).encode(),
            "unreadable probe",
        ),
    ]
    # a node's batch: its bad entry is refused alone, as a message of that entry alone; the
    # good one (a task that does not exist) loses its claim and is dropped
    bad = {"dispatch": {**dispatch, "version": -1}}
    batch = {"schema_version": 1, "dispatches": [{"dispatch": dispatch, "headers": {}}, bad]}
    alone = {"schema_version": 1, "dispatches": [bad]}
    refused_alone = [(json.dumps(alone, separators=(",", ":")).encode(), "unreadable dispatch")]
    connection = await aio_pika.connect_robust(settings.rabbitmq_url)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        for exchange, key, body, _ in poison:
            await publish(channel, exchange, key, body)
        await publish(channel, DISPATCH_EXCHANGE, "n1", json.dumps(batch).encode())
        reasons = await dead_letters(channel, len(poison) + 1)
    for body, why in [*((body, why) for _, _, body, why in poison), *refused_alone]:
        assert body in reasons, body[:80]
        assert why in reasons[body], reasons[body]
    # and everything still works
    task = await client.submit(VALID)
    assert (await client.wait(task, timeout=30)).result == 3
    never_restarted(deployment)


async def test_hostile_output_leaves_the_executor_running(
    deployment: Deployment, client: SkedClient
) -> None:
    await deployment.start("scheduler")
    await deployment.start("relay")
    executor = await deployment.executor("out", 2)
    specs = {
        "nul and bad utf-8": {
            "name": "bytes",
            "job": {"kind": "command", "argv": ["sh", "-c", r"printf 'a\000b\377\376c\n'"]},
        },
        "NaN": {"name": "nan", "job": {"kind": "handler", "handler": "tests.e2e.jobs:nan"}},
        "NaN declared": {
            "name": "nan-out",
            "job": {"kind": "command", "argv": ["sh", "-c", 'echo NaN > "$SKED_OUTPUT"']},
        },
        "20 MB result": {
            "name": "big",
            "job": {"kind": "handler", "handler": "tests.e2e.jobs:big", "args": [20_000_000]},
        },
        "2 MB result": {
            "name": "large",
            "job": {"kind": "handler", "handler": "tests.e2e.jobs:big", "args": [2_000_000]},
        },
        "NUL in a result": {
            "name": "nul",
            "job": {"kind": "handler", "handler": "tests.e2e.jobs:nul"},
        },
    }
    ids = dict(zip(specs, await client.submit_many(list(specs.values())), strict=True))
    done = await client.wait_all(list(ids.values()), timeout=60)
    by = {name: done[i] for name, i in ids.items()}
    assert by["nul and bad utf-8"].status is State.SUCCESS
    assert by["nul and bad utf-8"].log_tail == "a\\0b\ufffd\ufffdc\n"
    assert by["NaN"].status is State.FAILED
    assert "result is not JSON" in (by["NaN"].error or "")
    assert by["NaN declared"].status is State.FAILED
    assert "NaN is not a JSON number" in (by["NaN declared"].error or "")
    assert by["20 MB result"].status is State.FAILED
    assert "result too large" in (by["20 MB result"].error or "")
    assert (by["NUL in a result"].status, by["NUL in a result"].result) == (State.SUCCESS, "a\\0b")
    assert by["2 MB result"].status is State.FAILED
    assert "over the limit" in (by["2 MB result"].error or "")
    after = await client.submit(VALID)
    assert (await client.wait(after, timeout=30)).result == 3
    assert executor.proc.poll() is None
    never_restarted(deployment)


async def test_tasks_never_see_the_deployment_s_secrets(
    deployment: Deployment, client: SkedClient, settings: Settings
) -> None:
    await deployment.start("scheduler")
    await deployment.start("relay")
    await deployment.executor("secrets", 2, env={"AWS_SECRET_ACCESS_KEY": "aws-secret"})
    shell = await client.submit({"name": "env", "job": {"kind": "command", "argv": ["env"]}})
    py = await client.submit(
        {"name": "environ", "job": {"kind": "handler", "handler": "tests.handlers:whole_environ"}}
    )
    getenv = await client.submit(
        {
            "name": "getenv",
            "job": {"kind": "handler", "handler": "os:getenv", "args": ["SKED_DATABASE_URL"]},
        }
    )
    done = await client.wait_all([shell, py, getenv], timeout=60)
    seen_by_shell = dict(
        line.split("=", 1) for line in (done[shell].log_tail or "").splitlines() if "=" in line
    )
    for env in (seen_by_shell, done[py].result):
        leaked = {k for k in env if k.startswith("SKED_") and k.endswith("_URL")}
        leaked -= {"SKED_HEARTBEAT_URL"}  # where a task may beat: not a secret
        assert not leaked, leaked
        assert "SKED_HEARTBEAT_SECRET" not in env
        assert "AWS_SECRET_ACCESS_KEY" not in env
        assert settings.heartbeat_secret not in json.dumps(env)
        assert set(env) <= {
            "PATH",
            "HOME",
            "LANG",
            "TZ",
            "SKED_TASK_ID",
            "SKED_ATTEMPT",
            "SKED_OUTPUT",
            "SKED_HEARTBEAT_URL",
            "SKED_HEARTBEAT_TOKEN",
            "PWD",
            "SHLVL",
            "_",
        }, set(env)
    assert (done[getenv].status, done[getenv].result) == (State.SUCCESS, None)


def test_every_service_prints_usage_and_starts_nothing() -> None:
    # nothing listens there: a service that started would fail or hang, not exit 0 at once
    env = {"SKED_DATABASE_URL": "postgresql://127.0.0.1:9/none", "PATH": "/usr/bin:/bin"}
    for name in ("scheduler", "executor", "relay", "heartbeat-monitor", "recovery"):
        out = subprocess.run(
            [SKED, "service", name, "--help"], env=env, capture_output=True, timeout=30, text=True
        )
        assert out.returncode == 0, (name, out.stderr)
        assert out.stdout.startswith(f"usage: sked service {name}"), (name, out.stdout)
        assert "SKED_" in out.stdout, name


async def test_a_spec_at_the_sdk_s_limit_is_admitted(
    deployment: Deployment, client: SkedClient
) -> None:
    """What the SDK lets through, intake takes: a spec of the largest size it sends (the
    message limit less ENVELOPE_BYTES), alone and in a batch, becomes a task and runs; one
    byte more is refused at the caller (tests/integration/test_client_submit.py)."""
    await deployment.start("scheduler")
    await deployment.start("relay")
    await deployment.executor("big", 2)
    fits = client.settings.max_message_bytes - ENVELOPE_BYTES

    def sized(n: int) -> dict[str, Any]:
        # the bytes in environment variables under exec's limit on one string (128 KiB)
        env = {f"V{i}": "" for i in range(12)}
        spec = {"name": "big", "job": {"kind": "command", "argv": ["true"], "env": env}}
        missing = n - len(TaskSpec.parse(spec).model_dump_json())
        for i in range(12):
            env[f"V{i}"] = "x" * (missing // 12 + (i < missing % 12))
        assert len(TaskSpec.parse(spec).model_dump_json()) == n
        return spec

    ids = [await client.submit(sized(fits)), *await client.submit_many([sized(fits)] * 2)]
    with pytest.raises(InvalidSpec, match="SKED_MAX_MESSAGE_BYTES"):
        await client.submit(sized(fits + 1))
    done = await client.wait_all(ids, timeout=60)
    assert {t.status for t in done.values()} == {State.SUCCESS}, done
    never_restarted(deployment)
