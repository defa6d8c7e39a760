"""`sked dev` as an operator runs it: one process that starts the whole deployment, shows
every service's log lines under its name, and stops it all on SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

import pytest

from services.dev import Child, _pump
from shared.client import SkedClient
from shared.fsm import State


async def test_sked_dev_runs_a_task_and_stops_on_sigterm(
    service_env: dict[str, str], client: SkedClient, tmp_path: Path
) -> None:
    env = {
        **service_env,
        "SKED_MONITOR_PORT": "0",
        "SKED_API_PORT": "0",
        "SKED_STATE_DIR": str(tmp_path / "state"),
    }
    dev = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.cli", "dev", "--executors", "1", "--slots", "2",
        "--metrics-port", "-1",
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    out = bytearray()

    async def read() -> None:
        assert dev.stdout is not None
        while chunk := await dev.stdout.read(1 << 16):
            out.extend(chunk)

    reader = asyncio.create_task(read())
    try:
        async with asyncio.timeout(60):
            spec = {"name": "talk", "job": {"kind": "command", "argv": ["echo", "hi"]}}
            task_id = await client.submit(spec)
            assert (await client.wait(task_id)).status is State.SUCCESS
        dev.send_signal(signal.SIGTERM)
        async with asyncio.timeout(60):
            code = await dev.wait()
            await reader
    finally:
        if dev.returncode is None:
            dev.kill()
            await dev.wait()
        reader.cancel()
    text = out.decode(errors="replace")
    assert code == 0, text[-3000:]
    for name in ("scheduler", "relay", "monitor", "recovery", "api", "dev-1"):
        assert f"{name:>10} | " in text, f"no line of {name}"


LONG_LINE = 200_000  # past asyncio's 64 KiB line limit, and a pipe's buffer


async def test_a_service_s_long_log_line_does_not_hang_the_deployment(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`sked dev` read its children's output a line at a time under asyncio's 64 KiB limit:
    a service that logged a longer line (a traceback with a big repr) ended the reader with
    LimitOverrunError; the pipe then filled, and the service hung on its next log line, the
    deployment with it. Lines now pass whatever their length."""
    script = f"import sys; print('y' * {LONG_LINE}); sys.stdout.write(('z' * 999 + chr(10)) * 2000)"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, stdout=asyncio.subprocess.PIPE
    )
    try:
        async with asyncio.timeout(30):
            await asyncio.gather(_pump(Child("svc", proc), "36", False), proc.wait())
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    lines = capsys.readouterr().out.splitlines()
    assert proc.returncode == 0
    assert lines[0] == "       svc | " + "y" * LONG_LINE
    assert len(lines) == 2001
    assert lines[-1] == "       svc | " + "z" * 999
