"""Records of attempts in flight (state_dir/running): the next executor on this state_dir kills
what a crashed one left behind, should its warden and shims have died with it."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
from pathlib import Path
from typing import Any
from uuid import UUID

from services.executor.backends.local.files import remove
from services.executor.warden.proctree import stat

log = logging.getLogger(__name__)

Key = tuple[UUID, int]


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


class Records:
    """state_dir/running: the process groups to kill should this executor die with its warden
    and shims: `<task_id>-<attempt>.json` per command attempt in flight, `<name>.worker` per
    handler worker. A handler job has no record of its own: its worker's names its group,
    which is killed at the next start whether the worker was busy or idle (an idle worker's
    group held only the worker, gone with it). A record per job, a hard link made and removed
    around each, cost ~7 % of an executor's CPU in a burst of no-op handlers."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._root = str(root)
        self.boot_id = _boot_id()

    def _path(self, key: Key) -> str:
        # a string, not a Path: linked and removed around every handler job
        return f"{self._root}/{key[0]}-{key[1]}.json"

    def _write(self, path: Path, pid: int, start_time: int | None) -> None:
        record = {
            "pid": pid,
            "pgid": pid,  # a session leader: its pid names its group
            "start_time": start_time,
            "boot_id": self.boot_id,
        }
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)  # a crash mid-write leaves a stray .tmp, never a torn record

    def add(self, key: Key, pid: int, start_time: int | None) -> None:
        self._write(Path(self._path(key)), pid, start_time)

    def add_worker(self, name: str, pid: int, start_time: int | None) -> Path:
        path = self.root / f"{name}.worker"
        self._write(path, pid, start_time)
        return path

    def remove(self, key: Key) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path(key))

    def reap(self) -> list[Key]:
        """Kill what the command attempts and handler workers recorded by a dead executor left
        running; drop the records. Returns the command attempts reaped."""
        reaped = []
        for path in sorted(self.root.iterdir()):
            if path.suffix == ".json":
                try:
                    task_id, _, attempt = path.stem.rpartition("-")
                    key = (UUID(task_id), int(attempt))
                    record = json.loads(path.read_text())
                    killed = self._kill_leftover(record)
                except (OSError, ValueError, KeyError, TypeError) as exc:
                    log.warning("dropping unreadable attempt record %s: %s", path, exc)
                else:
                    log.warning(
                        "reaped attempt %s/%s left running by a previous executor: %s",
                        *key,
                        f"killed process group {record['pgid']}" if killed else "it was gone",
                        extra={"task_id": key[0], "attempt": key[1]},
                    )
                    reaped.append(key)
            elif path.suffix == ".worker":
                try:
                    record = json.loads(path.read_text())
                    killed = self._kill_leftover(record)
                except (OSError, ValueError, KeyError, TypeError) as exc:
                    log.warning("dropping unreadable worker record %s: %s", path, exc)
                else:
                    if killed:
                        log.warning(
                            "reaped handler worker %s left by a previous executor: killed "
                            "process group %s (what its last job started)",
                            path.stem,
                            record["pgid"],
                        )
            remove(path)  # and stray .tmp files (or what a task put here)
        return reaped

    def _kill_leftover(self, record: dict[str, Any]) -> bool:
        pid, pgid, started = int(record["pid"]), int(record["pgid"]), record["start_time"]
        if started is None or self.boot_id is None or record.get("boot_id") != self.boot_id:
            return False  # no way to tell it from a later process, or rebooted since
        leader = stat(pid)
        if leader is not None:
            if leader.start_time != started:
                return False  # the pid was reused, so our group is gone
        elif not any(
            (member := stat(int(name))) is not None
            and member.pgid == pgid
            and member.start_time >= started
            for name in os.listdir("/proc")
            if name.isdigit()
        ):
            # The leader died (PDEATHSIG) but members may live on; and the kernel never reissues
            # a pid still in use as a group id, so members found here are our group's.
            return False
        _signal_group(pgid, signal.SIGKILL)
        return True
