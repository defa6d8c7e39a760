"""One clock: services whose host clocks are a minute off (libfaketime), some ahead and some
behind, time nothing wrong — retries wait their backoff, a killed executor's tasks run again
within the heartbeat timeout + 2 s, and nothing alive is declared Lost. Every due time is
Postgres's, every wait a local monotonic duration."""

from __future__ import annotations

import asyncio
import glob
import time
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from shared.client import SkedClient
from shared.fsm import State
from tests.e2e.checks import check_all_histories
from tests.faults.checks import duplicated, overlap_s, read_stamps
from tests.faults.conftest import Deployment, Row
from tests.faults.jobs import FAST, cut_short_specs, shell_stamp
from tests.helpers import eventually

TIMEOUT = 3.0
BACKOFF_S = 2.0  # base = cap: the first retry's ceiling
STAMP_SLACK_S = 0.05  # Postgres stamps the events and next_retry_at in different statements


def faketime(offset: str) -> dict[str, str]:
    found = sorted(glob.glob("/usr/lib/*/faketime/libfaketime.so.1"))
    if not found:
        pytest.fail("libfaketime is missing: scripts/test installs Debian's faketime package")
    return {**FAST, "LD_PRELOAD": found[0], "FAKETIME": offset, "FAKETIME_DONT_RESET": "1"}


AHEAD, BEHIND = faketime("+60s"), faketime("-60s")


async def on_node(pool: asyncpg.Pool, ids: list[Any], node: str, attempt: int) -> int:
    n: int = await pool.fetchval(
        "SELECT count(*) FROM tasks WHERE status = 'running' AND node = $1 AND attempt = $2 "
        "AND id = ANY($3::uuid[])",
        node,
        attempt,
        ids,
    )
    return n


async def test_clocks_a_minute_off_change_no_timing(
    deployment: Deployment,
    client: SkedClient,
    pool: asyncpg.Pool,
    stamps: Path,
    record: list[Row],
) -> None:
    await deployment.start("scheduler", env=BEHIND)
    await deployment.start("relay", env=AHEAD)
    await deployment.start("recovery", env=AHEAD)
    await deployment.start("heartbeat-monitor", "--port", "0", env=BEHIND, ready="listening on")
    doomed = await deployment.executor("doomed", 6, env=AHEAD)
    # the clocks really are off, as the services see them
    assert abs(time.time() + 60 - float(await _clock(deployment, AHEAD))) < 5

    killed_ids = await client.submit_many(cut_short_specs(stamps, "killed", 6, 1, TIMEOUT, 1))

    async def all_on_doomed() -> bool:
        return await on_node(pool, killed_ids, "doomed", 1) == 6

    await eventually(all_on_doomed, timeout=60, what="6 tasks running on the doomed node")
    await deployment.executor("ahead", 8, env=AHEAD)
    await deployment.executor("behind", 8, env=BEHIND)

    retried = [
        {
            "name": f"fails-once-{i}",
            "job": {
                "kind": "command",
                "argv": ["sh", "-c", '[ "$SKED_ATTEMPT" = 1 ] && exit 1; exit 0'],
            },
            "max_retries": 1,
            "backoff_base_s": BACKOFF_S,
            "backoff_cap_s": BACKOFF_S,
        }
        for i in range(6)
    ]
    alive = [
        {
            "name": f"alive-{i}",
            "job": {"kind": "command", "argv": shell_stamp(stamps, 2 * TIMEOUT + 2)},
            "heartbeat_timeout_s": TIMEOUT,
        }
        for i in range(4)
    ]
    retried_ids = await client.submit_many(retried)
    alive_ids = await client.submit_many(alive)
    killed_at = await pool.fetchval("SELECT now()")
    doomed.kill()

    async def all_back() -> bool:
        back = sum([await on_node(pool, killed_ids, n, 2) for n in ("ahead", "behind")])
        done = await pool.fetchval(
            "SELECT count(*) FROM tasks WHERE attempt = 2 AND id = ANY($1::uuid[])", killed_ids
        )
        return back == 6 or done == 6

    await eventually(all_back, timeout=60, what="the killed executor's tasks running again")
    rerun = await pool.fetchval(
        "SELECT max(started_at) FROM tasks WHERE id = ANY($1::uuid[])", killed_ids
    )
    recovery_s = (rerun - killed_at).total_seconds()
    done = await client.wait_all([*killed_ids, *retried_ids, *alive_ids], timeout=90)

    # retries waited their backoff (1-2 s drawn), measured on Postgres's clock
    waits = []
    for task_id in retried_ids:
        events = {(e.from_status, e.to_status): e.at for e in await client.history(task_id)}
        task = done[task_id]
        assert task.next_retry_at is not None
        backoff = (task.next_retry_at - events[(State.FAILED, State.RETRY_WAIT)]).total_seconds()
        late = (events[(State.RETRY_WAIT, State.READY)] - task.next_retry_at).total_seconds()
        waits.append((round(backoff, 2), round(late, 2)))
        # equal jitter (shared/backoff.py) draws the first backoff from [ceiling/2, ceiling]
        # = [1, 2] s; a host clock 60 s off would show here as ~60 s
        low, high = BACKOFF_S / 2 - STAMP_SLACK_S, BACKOFF_S + STAMP_SLACK_S
        assert low <= backoff <= high, f"backoff {backoff} s outside equal jitter: {waits}"
        assert 0.0 <= late <= 1.0, waits
    lost_alive = await pool.fetchval(
        "SELECT count(*) FROM task_events WHERE to_status = 'lost' AND task_id = ANY($1::uuid[])",
        [*alive_ids, *retried_ids],
    )
    runs = read_stamps(stamps)
    print(
        f"\nclocks +-60 s: retries (backoff drawn, late after due) {waits}; killed executor's "
        f"tasks running again {recovery_s:.2f} s after the kill (timeout {TIMEOUT:g} s)"
    )
    lost = sum(t.status is not State.SUCCESS for t in done.values())
    record.append(
        Row(
            "clocks 60 s ahead and behind; executor SIGKILLed",
            16,
            lost + lost_alive,
            duplicated(runs, killed_at.timestamp()),
            recovery_s,
            overlap_s(runs, killed_at.timestamp()),
        )
    )
    assert lost == 0
    assert lost_alive == 0, "a live task was declared Lost"
    assert all(done[i].attempt == 1 for i in alive_ids)
    assert recovery_s <= TIMEOUT + 2.0, f"recovery took {recovery_s:.2f} s"
    assert duplicated(runs, killed_at.timestamp()) == 0
    await check_all_histories(pool)


async def _clock(deployment: Deployment, env: dict[str, str]) -> str:
    """What `date +%s` says under `env`'s fake clock."""
    proc = await asyncio.create_subprocess_exec(
        "date", "+%s", env={**env, "PATH": "/usr/bin:/bin"}, stdout=asyncio.subprocess.PIPE
    )
    out, _ = await proc.communicate()
    return out.decode().strip()
