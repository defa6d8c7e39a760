"""`sked` as an operator runs it, against the real servers: `sked list` pages through every
task; a bad argument, a database that is not there or not migrated, a RabbitMQ vhost that is
not there, is a one-line error with exit code 2, never a traceback, and changes nothing."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import subprocess
from pathlib import Path
from uuid import UUID, uuid4

import asyncpg

from shared import workflows
from shared.dag import WorkflowSpec
from shared.store import Store
from tests.conftest import PG_BASE
from tests.helpers import SKED, spec


def sked(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([SKED, *args], env=env, capture_output=True, text=True, timeout=60)


def write(path: Path, content: str | bytes) -> str:
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    return str(path)


def refused(done: subprocess.CompletedProcess[str], says: str) -> None:
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr
    assert says in done.stderr, done.stderr


async def test_list_pages_through_every_task(store: Store, service_env: dict[str, str]) -> None:
    """Each full page says how to ask for the next, the filters kept."""
    made = [await store.tasks.create(spec("t")) for _ in range(5)]
    await store.tasks.create(spec("other"))
    seen: list[str] = []
    args = ["list", "--limit", "2", "--name", "t"]
    while True:
        done = sked(service_env, *args)
        assert done.returncode == 0, done.stderr
        seen += [line.split()[0] for line in done.stdout.splitlines()]
        more = re.search(r"^more: sked (.*)$", done.stderr, re.MULTILINE)
        if more is None:  # a short page says nothing more
            break
        args = more[1].split()
    assert seen == [str(t.id) for t in reversed(made)]


async def test_workflows_page_through_every_workflow(
    store: Store, service_env: dict[str, str]
) -> None:
    """`sked workflows` lists newest first with each one's status and counts, by pages."""
    spec = WorkflowSpec.parse({"name": "pair", "tasks": [{"name": "a", "command": ["true"]}]})
    made = [uuid4() for _ in range(3)]
    for wf in made:
        await workflows.admit(store, wf, spec)
    seen: list[str] = []
    args = ["workflows", "--limit", "2", "--name", "pair"]
    while True:
        done = sked(service_env, *args)
        assert done.returncode == 0, done.stderr
        for line in done.stdout.splitlines():
            assert re.fullmatch(r"\S+  running +\S+ \S+  pair  \(1 Ready\)", line), line
            seen.append(line.split()[0])
        more = re.search(r"^more: sked (.*)$", done.stderr, re.MULTILINE)
        if more is None:
            break
        args = more[1].split()
    assert seen == [str(wf) for wf in reversed(made)]


async def test_bad_arguments_and_a_database_not_ready_are_clear_errors(
    store: Store, service_env: dict[str, str]
) -> None:
    refused(sked(service_env, "list", "--limit", "0"), "from 1 to 1000")
    refused(sked(service_env, "list", "--after", "nope"), "not a task id")
    refused(sked(service_env, "list", "--after", str(UUID(int=3))), "to list after")
    for args in (["wait", str(UUID(int=3))], ["node", "drain", "n"], ["submit-workflow", "f"]):
        flag = "--wait-timeout" if args[0] == "submit-workflow" else "--timeout"
        for bad in ("nan", "-1", "soon"):  # NaN would wait forever
            refused(sked(service_env, *args, flag, bad), "a number of seconds, 0 or more")
    # the maintenance database exists and holds no tables of sked's: never migrated
    bare = {**service_env, "SKED_DATABASE_URL": f"{PG_BASE}/postgres"}
    for args in (["list"], ["status", str(UUID(int=3))]):
        refused(sked(bare, *args), "is the database migrated?")
    gone = {**service_env, "SKED_DATABASE_URL": f"{PG_BASE}/sked_no_such_database"}
    refused(sked(gone, "list"), 'database "sked_no_such_database" does not exist')


BOMB = "\n".join(
    [
        'l0: &l0 ["x", "x", "x", "x", "x", "x", "x", "x", "x"]',
        *(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 8)),
        "name: w",
        "tasks: [{name: t, handler: 'tests.handlers:echo', args: {x: *l7}}]",
    ]
)
ANCHORED = """
name: w
tasks:
  - &first {name: a, handler: "tests.handlers:noop", priority: 2}
  - {<<: *first, name: b, needs: [a]}
"""


async def test_bad_input_is_refused_before_anything_is_sent(
    store: Store, service_env: dict[str, str], tmp_path: Path
) -> None:
    before = await store.degrade.read()
    nowhere = {**service_env, "SKED_RABBITMQ_URL": "amqp://guest:guest@127.0.0.1/sked_no_vhost"}
    for args, says in (
        (["submit", "--command", "true", "--selector", "bad"], "--selector: a label must"),
        (["submit", "--command", "true", "--affinity", "{bad"], "--affinity: Expecting"),
        (["submit", "--command", "true", "--args", "{}"], "--args goes with --handler"),
        (["degrade", "partial", "--reason", "x", "--for", "nan"], "must be above 0"),
        (["degrade", "partial", "--reason", "x", "--for", "1e300"], "must be above 0"),
        (["degrade", "partial"], "--reason is required"),
        (["submit-workflow", write(tmp_path / "bomb.yaml", BOMB)], "over 1,000,000 values"),
        (["submit-workflow", write(tmp_path / "bad.yaml", b"\xff\xfe")], "is not UTF-8"),
    ):
        refused(sked(nowhere, *args), says)  # refused before RabbitMQ is asked anything
    refused(sked(nowhere, "degrade", "full", "--reason", "x"), "is the vhost in SKED_RABBITMQ_URL")
    # anchors and merge keys are fine: this one is read and validated, then meets no vhost
    anchored = write(tmp_path / "anchored.yaml", ANCHORED)
    refused(sked(nowhere, "submit-workflow", anchored), "is the vhost in SKED_RABBITMQ_URL")
    assert await store.degrade.read() == before
    assert await store.tasks.list_tasks() == []


async def test_logs_as_json(store: Store, service_env: dict[str, str]) -> None:
    task = await store.tasks.create(spec("quiet"))
    done = sked(service_env, "logs", str(task.id), "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"id": str(task.id), "status": "created", "log": None}


def sked_on_a_terminal(env: dict[str, str], *args: str) -> tuple[int, bytes]:
    """`sked ARGS` with its stdout on a pseudo-terminal, as an operator's shell runs it: its
    exit code and the bytes the terminal received."""
    leader, follower = pty.openpty()
    try:
        proc = subprocess.Popen([SKED, *args], env=env, stdout=follower, stderr=subprocess.PIPE)
        os.close(follower)
        out = b""
        while True:
            ready, _, _ = select.select([leader], [], [], 60)
            assert ready, "no output from sked within 60 s"
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: every writer closed the terminal
                break
            if not chunk:
                break
            out += chunk
        assert proc.stderr is not None
        with proc.stderr:
            assert proc.wait(timeout=60) == 0, proc.stderr.read()
        return proc.returncode, out
    finally:
        os.close(leader)


async def test_a_log_s_escape_sequences_do_not_reach_the_operator_s_terminal(
    store: Store, pool: asyncpg.Pool, service_env: dict[str, str]
) -> None:
    """A task writes its log: `sked logs` wrote it to the terminal as it was, so a task could
    retitle the operator's terminal, clear it, hide lines, or (OSC 52) set their clipboard.
    On a terminal the controls other than line breaks and tabs are now written as escapes;
    piped, and with --raw, the log is written as it is."""
    task = await store.tasks.create(spec("loud"))
    log = "line one\n\x1b]0;owned\x07\x1b[2Jtab\there\n\x1b]52;c;ZWNobyBvd25lZA==\x07end\n"
    await pool.execute("UPDATE tasks SET log_tail = $2 WHERE id = $1", task.id, log)
    code, shown = sked_on_a_terminal(service_env, "logs", str(task.id))
    assert code == 0
    assert b"\x1b" not in shown, shown
    assert b"\x07" not in shown, shown
    assert b"\\x1b]0;owned\\x07\\x1b[2Jtab\there" in shown, shown
    piped = sked(service_env, "logs", str(task.id))
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout == log
    code, raw = sked_on_a_terminal(service_env, "logs", str(task.id), "--raw")
    assert code == 0
    assert b"\x1b]0;owned\x07" in raw
