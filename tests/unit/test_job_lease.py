"""What the executor tells a handler worker's shim when a job starts (Proc.lease_job): the
shim's deadline from the previous job stands when it ends no later than the new job's lease
and not much sooner; otherwise the new lease is sent. Real pipes, no shim: the test reads
what the shim would."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator

import pytest

from services.executor.backends.local.process import JOB_SLACK_S, Proc


@pytest.fixture
async def proc() -> AsyncIterator[tuple[Proc, int]]:
    ctl_r, ctl_w = os.pipe()
    report_r, report_w = os.pipe()
    os.set_blocking(ctl_r, False)
    p = Proc(ctl_w, report_r)
    yield p, ctl_r
    asyncio.get_running_loop().remove_reader(report_r)
    for fd in (ctl_r, ctl_w, report_r, report_w):
        os.close(fd)


def told(ctl: int) -> list[str]:
    try:
        return os.read(ctl, 4096).decode().split("\n")[:-1]
    except BlockingIOError:
        return []


async def test_back_to_back_jobs_leave_the_deadline_standing(proc: tuple[Proc, int]) -> None:
    p, ctl = proc
    p.lease_job(30.0)
    assert told(ctl) == ["renew 30.000"]
    await asyncio.sleep(0.01)
    p.lease_job(30.0)  # the first deadline ends 10 ms sooner: no later, and close enough
    assert told(ctl) == []


async def test_a_shorter_lease_is_sent(proc: tuple[Proc, int]) -> None:
    p, ctl = proc
    p.lease_job(30.0)
    told(ctl)
    p.lease_job(10.0)  # the shim's deadline would come too late for this job
    assert told(ctl) == ["renew 10.000"]


async def test_a_much_longer_lease_is_sent(proc: tuple[Proc, int]) -> None:
    p, ctl = proc
    p.lease_job(5.0)
    told(ctl)
    p.lease_job(5.0 + 2 * JOB_SLACK_S)  # the old deadline would freeze this job too soon
    assert told(ctl) == [f"renew {5.0 + 2 * JOB_SLACK_S:.3f}"]


async def test_a_frozen_or_unleased_worker_is_told(proc: tuple[Proc, int]) -> None:
    p, ctl = proc
    p.lease_job(30.0)
    p.unlease()
    told(ctl)
    p.lease_job(30.0)  # no deadline held: the lease must be sent
    assert told(ctl) == ["renew 30.000"]
    p.frozen = True  # as the shim reported
    p.lease_job(30.0)  # the renewal is what thaws it
    assert told(ctl) == ["renew 30.000"]


async def test_a_pending_unlease_is_called_off(proc: tuple[Proc, int]) -> None:
    p, ctl = proc
    p.lease_job(0.6)  # the drop is due 0.1 s from now (UNLEASE_AHEAD_S before the end)
    p.unlease_soon()
    p.lease_job(0.6)
    told(ctl)
    await asyncio.sleep(0.3)
    assert told(ctl) == [], "the idle worker's lease was dropped under a running job"
