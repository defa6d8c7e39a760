"""`sked list` as an operator runs it, against real Postgres: pages through every task, and a
database that is not there, or not migrated, or a bad argument, is a one-line error with exit
code 2, never a traceback."""

from __future__ import annotations

import re
import subprocess
from uuid import UUID

from shared.store import Store
from tests.conftest import PG_BASE
from tests.helpers import SKED, spec


def sked(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([SKED, *args], env=env, capture_output=True, text=True, timeout=60)


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


async def test_bad_arguments_and_a_database_not_ready_are_clear_errors(
    store: Store, service_env: dict[str, str]
) -> None:
    refused(sked(service_env, "list", "--limit", "0"), "from 1 to 1000")
    refused(sked(service_env, "list", "--after", "nope"), "not a task id")
    refused(sked(service_env, "list", "--after", str(UUID(int=3))), "to list after")
    # the maintenance database exists and holds no tables of sked's: never migrated
    bare = {**service_env, "SKED_DATABASE_URL": f"{PG_BASE}/postgres"}
    for args in (["list"], ["status", str(UUID(int=3))]):
        refused(sked(bare, *args), "is the database migrated?")
    gone = {**service_env, "SKED_DATABASE_URL": f"{PG_BASE}/sked_no_such_database"}
    refused(sked(gone, "list"), 'database "sked_no_such_database" does not exist')
