"""A real Alertmanager for tests (Debian's prometheus-alertmanager; scripts/test installs it):
started on a free port with a throwaway config and storage, stopped by pid."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp

CONFIG = """\
route:
  receiver: blackhole
  group_wait: 0s
receivers:
  - name: blackhole
"""


def binary() -> str | None:
    return shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.asynccontextmanager
async def alertmanager(workdir: Path) -> AsyncIterator[str]:
    """An Alertmanager on 127.0.0.1; yields its base URL."""
    path = binary()
    assert path, "prometheus-alertmanager is not installed (scripts/test installs it)"
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "alertmanager.yml").write_text(CONFIG)
    port = free_port()
    log = (workdir / "alertmanager.log").open("wb")
    proc = subprocess.Popen(
        [
            path,
            f"--config.file={workdir / 'alertmanager.yml'}",
            f"--storage.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--cluster.listen-address=",  # no gossip: one instance
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as http, asyncio.timeout(30):
            while True:
                if proc.poll() is not None:
                    raise AssertionError((workdir / "alertmanager.log").read_text())
                with contextlib.suppress(aiohttp.ClientError):
                    async with http.get(f"{url}/-/ready") as resp:
                        if resp.status == 200:
                            break
                await asyncio.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()


async def alerts(url: str, **labels: str) -> list[dict[str, Any]]:
    """The alerts Alertmanager holds (active and not), optionally those with these labels."""
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"{url}/api/v2/alerts", params={"silenced": "true"}) as resp,
    ):
        resp.raise_for_status()
        found: list[dict[str, Any]] = await resp.json()
    return [a for a in found if all(a["labels"].get(k) == v for k, v in labels.items())]
