"""`sked status ID`: the one command an operator runs over and over, so it loads as little as
it can. Straight to Postgres (no operator API configured) it reads through libpq
(shared.store.quick.read_task_now): no asyncio, no asyncpg, no settings model; where libpq is
not installed, through asyncpg; through the operator API when one is configured."""

from __future__ import annotations

import argparse
from uuid import UUID

from services.cli.output import parse_task_id, print_json, run, status_lines
from services.cli.remote import straight_to_postgres
from shared.task import Task


def status(args: argparse.Namespace) -> int:
    task_id = parse_task_id(args.id)
    dsn = straight_to_postgres()
    task: Task | None
    if dsn is not None:
        from shared.store.libpq import NotConnected, Unavailable
        from shared.store.quick import read_task, read_task_now

        try:
            task = read_task_now(dsn, task_id)
        except (Unavailable, NotConnected):
            # no libpq here, or it would not connect: asyncpg tries (and says why it failed,
            # alone: libpq's words, which may quote the URL, are not chained to its error)
            task = None
        if task is None:
            from shared.errors import InvalidSettings
            from shared.settings import DATABASE_SCHEMES, url_problem
            from shared.store.db import pinned_dsn  # asyncpg's module: loaded to read anyway

            if why := url_problem(dsn, DATABASE_SCHEMES):  # as a service checks it: one line
                raise InvalidSettings(f"invalid settings: SKED_DATABASE_URL: {why}")
            task = run(read_task(pinned_dsn(dsn), task_id))
    else:
        task = run(_through_api(task_id))
    if args.json:
        print_json(task.as_json())
    else:
        print("\n".join(status_lines(task)))
    return 0


async def _through_api(task_id: UUID) -> Task:
    from services.cli.remote import connect

    async with connect() as client:
        return await client.get(task_id)
