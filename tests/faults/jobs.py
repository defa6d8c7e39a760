"""What fault-injection tasks run: each attempt stamps its own start and end in a file, so the
tests can tell from the tasks' own output whether two attempts of a task ever overlapped."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any


def stamp(dir: str, ms: float = 0) -> int:
    """Append `<attempt> start <t>` and, after `ms` milliseconds, `<attempt> end <t>`."""
    path = Path(dir) / os.environ["SKED_TASK_ID"]
    attempt = os.environ["SKED_ATTEMPT"]
    with path.open("a") as f:
        f.write(f"{attempt} start {time.time():.6f}\n")
    time.sleep(ms / 1000)
    with path.open("a") as f:
        f.write(f"{attempt} end {time.time():.6f}\n")
    return int(attempt)


def shell_stamp(path: Path, seconds: float, first_attempt_s: float | None = None) -> list[str]:
    """The same for a command task: `sh -c` that stamps, sleeps, stamps. With
    `first_attempt_s`, attempt 1 sleeps that long instead (one a test will cut short)."""
    first = seconds if first_attempt_s is None else first_attempt_s
    script = (
        f'echo "$SKED_ATTEMPT start $(date +%s.%N)" >> {path}/$SKED_TASK_ID; '
        f'if [ "$SKED_ATTEMPT" = 1 ]; then sleep {first}; else sleep {seconds}; fi; '
        f'echo "$SKED_ATTEMPT end $(date +%s.%N)" >> {path}/$SKED_TASK_ID'
    )
    return ["sh", "-c", script]


def cut_short_specs(
    stamps: Path, name: str, n: int, seconds: float, heartbeat_timeout_s: float, max_retries: int
) -> list[dict[str, Any]]:
    """`n` command tasks whose attempt 1 outlasts any test (it can end only by a kill, and
    would overlap its retry in the stamps were it orphaned); later attempts run `seconds`,
    retried after a short backoff."""
    return [
        {
            "name": f"{name}-{i}",
            "job": {"kind": "command", "argv": shell_stamp(stamps, seconds, first_attempt_s=120)},
            "heartbeat_timeout_s": heartbeat_timeout_s,
            "max_retries": max_retries,
            "backoff_base_s": 0.05,
            "backoff_cap_s": 0.1,
        }
        for i in range(n)
    ]


FAST = {
    "SKED_NODE_HEARTBEAT_S": "0.5",  # executors beat twice a second
    "SKED_RECOVERY_PERIOD_S": "1",
    "SKED_PROBE_TIMEOUT_S": "1",
    "SKED_STUCK_SCHEDULING_S": "10",
}


def stamp_specs(d: Path, n: int, ms: float, **spec: Any) -> list[dict[str, Any]]:
    """`n` handler tasks that stamp into `d` and take `ms` milliseconds each."""
    return [
        {
            "name": f"t{i}",
            "job": {
                "kind": "handler",
                "handler": "tests.faults.jobs:stamp",
                "args": {"dir": str(d), "ms": ms},
            },
            **spec,
        }
        for i in range(n)
    ]


async def start_all(deployment: Any, nodes: list[str], slots: int) -> dict[str, Any]:
    """Scheduler, relay, recovery, a heartbeat-monitor on a free port, and executors."""
    procs = {
        name: await deployment.start(name, env=FAST) for name in ("scheduler", "relay", "recovery")
    }
    procs["heartbeat-monitor"] = await deployment.start(
        "heartbeat-monitor", "--port", "0", env=FAST, ready="listening on"
    )
    for node in nodes:
        procs[node] = await deployment.executor(node, slots, env=FAST)
    return procs
