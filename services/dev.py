"""`sked dev`: the whole deployment in one terminal, each service its own process.

Applies migrations, then runs the scheduler, the relay, the heartbeat-monitor, recovery, the
operator API (127.0.0.1:8480; `sked token create` makes a token) and N executors (`sked service …`),
prefixing every log line with its process's name. Each process serves its metrics on a port
of its own: the i-th (from 0, in the order above) on `--metrics-port` + i (default 9464 and
up; 0: each any free port, named in its log; -1: none). Ctrl-C (or SIGTERM) stops them all: each
gets SIGTERM and a grace period, then SIGKILL. If any one dies, the rest are stopped too and the
exit code says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import sys
from dataclasses import dataclass

from shared.runtime import run_main
from shared.settings import Settings
from shared.store.migrate import migrate

GRACE_S = 15.0
COLOURS = ["36", "33", "35", "32", "34", "31"]


@dataclass
class Child:
    name: str
    proc: asyncio.subprocess.Process


def _commands(executors: int, slots: int) -> list[tuple[str, list[str]]]:
    sked = [sys.executable, "-m", "services.cli", "service"]
    out = [
        ("scheduler", [*sked, "scheduler"]),
        ("relay", [*sked, "relay"]),
        ("monitor", [*sked, "heartbeat-monitor"]),
        ("recovery", [*sked, "recovery"]),
        ("api", [*sked, "api"]),
    ]
    for i in range(1, executors + 1):
        node = f"dev-{i}"
        out.append((node, [*sked, "executor", "--node-id", node, "--slots", str(slots)]))
    return out


async def _pump(child: Child, colour: str, tty: bool) -> None:
    """The child's output, each line under its name. Read in chunks, not with readline: a
    line past its 64 KiB limit (a traceback with a big repr) ended the reader, the child's
    pipe then filled, and the service hung on its next log line."""
    assert child.proc.stdout is not None
    prefix = f"\x1b[{colour}m{child.name:>10}\x1b[0m | " if tty else f"{child.name:>10} | "
    pending = b""
    while chunk := await child.proc.stdout.read(1 << 16):
        *lines, pending = (pending + chunk).split(b"\n")
        if lines:
            sys.stdout.write(
                "".join(f"{prefix}{line.decode(errors='replace')}\n" for line in lines)
            )
            sys.stdout.flush()
    if pending:
        sys.stdout.write(f"{prefix}{pending.decode(errors='replace')}\n")
        sys.stdout.flush()


def metrics_env(base: int, index: int) -> dict[str, str]:
    """SKED_METRICS_PORT for the `index`-th process: its own port above `base` (0: any free
    one; -1: metrics off)."""
    return {"SKED_METRICS_PORT": str(base + index if base > 0 else base)}


async def _dev(executors: int, slots: int, metrics_port: int) -> int:
    settings = Settings()
    await migrate(settings.database_url)
    # every process of this deployment signs and checks heartbeats with one secret, made here
    # unless one was given
    secret = settings.heartbeat_secret or secrets.token_hex(32)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    children: list[Child] = []
    tty = sys.stdout.isatty()
    pumps = []
    for i, (name, argv) in enumerate(_commands(executors, slots)):
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C reaches only us; we stop the children in order
            env={
                **os.environ,
                "PYTHONUNBUFFERED": "1",
                "SKED_HEARTBEAT_SECRET": secret,
                **metrics_env(metrics_port, i),
            },
        )
        child = Child(name, proc)
        children.append(child)
        pumps.append(asyncio.create_task(_pump(child, COLOURS[i % len(COLOURS)], tty)))
    exits = [asyncio.create_task(c.proc.wait()) for c in children]
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait([*exits, stopper], return_when=asyncio.FIRST_COMPLETED)
    crashed = [c.name for c in children if c.proc.returncode is not None]
    for child in children:
        if child.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                child.proc.terminate()
    _done, _pending = await asyncio.wait(exits, timeout=GRACE_S)
    for child in children:
        if child.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                child.proc.kill()
    await asyncio.gather(*exits)
    await asyncio.gather(*pumps, return_exceptions=True)
    stopper.cancel()
    return 1 if crashed else 0


def run_dev(executors: int, slots: int, metrics_port: int = 9464) -> int:
    if executors < 1:
        return 2
    code = 0

    async def main() -> None:
        nonlocal code
        code = await _dev(executors, slots, metrics_port)

    return run_main(main) or code
