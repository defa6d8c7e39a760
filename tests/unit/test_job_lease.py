"""What the executor tells a handler worker's shim when a job starts (Proc.lease_job): the
shim's deadline from the previous job stands when it ends no later than the new job's lease
and not much sooner; otherwise what is left of the new lease is sent. Leases are given as
their ends on the monotonic clock. Real pipes, no shim: the test reads what the shim would."""

from __future__ import annotations

import asyncio
import os
import time
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


def ends_in(seconds: float) -> float:
    return time.monotonic() + seconds


def renewed(lines: list[str]) -> list[float]:
    """The lengths of the leases sent, in seconds."""
    assert all(line.startswith("renew ") for line in lines), lines
    return [float(line.split()[1]) for line in lines]


async def test_back_to_back_jobs_leave_the_deadline_standing(proc: tuple[Proc, int]) -> None:
    p, ctl = proc
    p.lease_job(ends_in(30.0))
    assert renewed(told(ctl)) == [pytest.approx(30.0, abs=0.01)]
    await asyncio.sleep(0.01)
    p.lease_job(ends_in(30.0))  # the first deadline ends 10 ms sooner: no later, and close
    assert told(ctl) == []


async def test_jobs_of_one_claim_share_its_lease_end(proc: tuple[Proc, int]) -> None:
    p, ctl = proc
    until = ends_in(30.0)
    p.lease_job(until)
    told(ctl)
    await asyncio.sleep(0.05)
    p.lease_job(until)  # claimed by the same statement, started 50 ms later
    assert told(ctl) == []


async def test_a_lease_is_sent_as_what_is_left_of_it(proc: tuple[Proc, int]) -> None:
    p, ctl = proc
    until = ends_in(1.0)
    await asyncio.sleep(0.3)  # the job waited for its worker
    p.lease_job(until)
    [seconds] = renewed(told(ctl))
    assert 0.5 < seconds <= 0.7


async def test_a_shorter_lease_is_sent(proc: tuple[Proc, int]) -> None:
    p, ctl = proc
    p.lease_job(ends_in(30.0))
    told(ctl)
    p.lease_job(ends_in(10.0))  # the shim's deadline would come too late for this job
    assert renewed(told(ctl)) == [pytest.approx(10.0, abs=0.01)]


async def test_a_much_longer_lease_is_sent(proc: tuple[Proc, int]) -> None:
    p, ctl = proc
    p.lease_job(ends_in(5.0))
    told(ctl)
    p.lease_job(ends_in(5.0 + 2 * JOB_SLACK_S))  # the old deadline would freeze it too soon
    assert renewed(told(ctl)) == [pytest.approx(5.0 + 2 * JOB_SLACK_S, abs=0.01)]


async def test_a_frozen_or_unleased_worker_is_told(proc: tuple[Proc, int]) -> None:
    p, ctl = proc
    p.lease_job(ends_in(30.0))
    p.unlease()
    told(ctl)
    p.lease_job(ends_in(30.0))  # no deadline held: the lease must be sent
    assert renewed(told(ctl)) == [pytest.approx(30.0, abs=0.01)]
    p.frozen = True  # as the shim reported
    p.lease_job(ends_in(30.0))  # the renewal is what thaws it
    assert renewed(told(ctl)) == [pytest.approx(30.0, abs=0.01)]


async def test_a_pending_unlease_is_called_off(proc: tuple[Proc, int]) -> None:
    p, ctl = proc
    p.lease_job(ends_in(0.6))  # the drop is due 0.1 s from now (UNLEASE_AHEAD_S before it)
    p.unlease_soon()
    p.lease_job(ends_in(0.6))
    told(ctl)
    await asyncio.sleep(0.3)
    assert told(ctl) == [], "the idle worker's lease was dropped under a running job"
