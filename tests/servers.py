"""Real servers that tests start as processes of their own (not fakes): Prometheus, from
Debian's `prometheus` package (scripts/test installs it), on a free port with a temporary
storage directory and a scrape configuration written for the test."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest

PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
MISSING = (
    "the {} binary is missing: Debian's prometheus package provides it "
    "(scripts/test installs it: apt-get install prometheus prometheus-alertmanager)"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def scrape_config(jobs: Mapping[str, Sequence[str]], interval_s: float = 1.0) -> dict[str, Any]:
    """A Prometheus configuration scraping each job's host:port targets every `interval_s`."""
    every = f"{int(interval_s * 1000)}ms"
    return {
        "global": {"scrape_interval": every, "evaluation_interval": every},
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": list(targets)}]}
            for job, targets in jobs.items()
        ],
    }


class Prometheus:
    """One Prometheus process: started with `start`, stopped (by its pid, with bounded
    waits) with `stop`."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = directory / "prometheus.log"
        self.proc: subprocess.Popen[bytes] | None = None

    async def start(self, jobs: Mapping[str, Sequence[str]], timeout: float = 30.0) -> None:
        assert PROMETHEUS is not None, MISSING.format("prometheus")
        config = self.directory / "prometheus.yml"
        config.write_text(json.dumps(scrape_config(jobs)))  # JSON is YAML
        (self.directory / "data").mkdir(exist_ok=True)
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [
                    PROMETHEUS,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={self.directory / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as http:
            while True:
                if self.proc.poll() is not None:
                    raise AssertionError(f"prometheus exited early:\n{self.log()}")
                try:
                    async with http.get(f"{self.url}/-/ready") as r:
                        if r.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
                if time.monotonic() > deadline:
                    raise AssertionError(f"prometheus not ready in {timeout}s:\n{self.log()}")
                await asyncio.sleep(0.1)

    def log(self) -> str:
        return self.log_path.read_text("utf-8", errors="replace")

    async def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result vector (raises if Prometheus refuses the expression)."""
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"{self.url}/api/v1/query", params={"query": expr}) as r,
        ):
            body = await r.json()
        if body.get("status") != "success":
            raise AssertionError(f"query {expr!r} failed: {body}")
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    async def names(self) -> set[str]:
        """Every metric name Prometheus holds."""
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"{self.url}/api/v1/label/__name__/values") as r,
        ):
            return set((await r.json())["data"])

    def stop(self, timeout: float = 10.0) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Prometheus]:
    """A Prometheus of this test's own; the test starts it with its targets."""
    if PROMETHEUS is None:  # scripts/test installs it: missing is a broken test bed, not a skip
        pytest.fail(MISSING.format("prometheus"))
    directory = tmp_path / "prometheus"
    directory.mkdir()
    server = Prometheus(directory)
    yield server
    server.stop()
