"""Settings and service startup (`sked service NAME` as its own process, the way compose,
Kubernetes and `sked dev` start it), against mistaken settings and refusing or silent servers.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.settings import Settings, quick

ROOT = Path(__file__).resolve().parents[2]
PASSWORD = "hunter2probe"


def _start(env: dict[str, str], *argv: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "services.cli", "service", *argv],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(proc: subprocess.Popen[str], timeout: float) -> tuple[int | None, str]:
    """Its exit code (None: still running after `timeout`, then stopped) and its output."""
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out + err
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate(timeout=10)
        return None, out + err


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A TCP port that accepts connections and never says a word (a blackholed server, a
    wrong port that happens to be some other quiet service's)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()


def _listening(pid: int) -> list[str]:
    """The local addresses (hex, as /proc/net/tcp{,6} write them) `pid` listens on."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                found.append(cols[1].split(":")[0])
    return found


# -- a server that refuses or says nothing at start ----------------------------------------------


REFUSALS = {
    # what is wrong -> (the variable set, what the one line should name)
    "postgres-port-refused": (
        "SKED_DATABASE_URL",
        f"postgresql://postgres:{PASSWORD}@127.0.0.1:1/sked",
        "Postgres",
    ),
    "postgres-unknown-role": (
        "SKED_DATABASE_URL",
        f"postgresql://nosuchrole_probe:{PASSWORD}@127.0.0.1:5432/postgres",
        "Postgres",
    ),
    "rabbitmq-vhost-missing": (
        "SKED_RABBITMQ_URL",
        "amqp://guest:guest@127.0.0.1:5672/no_such_vhost_probe",
        "RabbitMQ",
    ),
    "rabbitmq-port-refused": (
        "SKED_RABBITMQ_URL",
        f"amqp://guest:{PASSWORD}@127.0.0.1:1/x",
        "RabbitMQ",
    ),
    "redis-db-out-of-range": ("SKED_REDIS_URL", "redis://127.0.0.1:6379/99", "Redis"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_server_refusing_at_start_is_one_clear_line_not_a_traceback(
    service_env: dict[str, str], case: str
) -> None:
    """`sked service scheduler` started against a Postgres on a wrong port or with a role it
    does not know, a RabbitMQ vhost that is not there, RabbitMQ on a wrong port, a Redis
    database index the server does not have. It should exit non-zero with one line naming the
    server and why, as the CLI's commands do. It exited 1 after a 40-60 line traceback
    through asyncpg / aiormq / redis internals; for the missing vhost the last line said only
    `Expected one of ['Connection.OpenOk'], got <Connection.Close ...>`. Now each server's
    first connect goes through shared.wiring.starting, which names the server and why."""
    var, value, server = REFUSALS[case]
    env = {**service_env, var: value}
    code, out = _finish(_start(env, "scheduler"), timeout=30)
    assert code not in (None, 0), f"still running or exit 0 with {case}: {out[-600:]}"
    assert "Traceback" not in out, f"{case}: a traceback instead of one line:\n{out[-1500:]}"
    assert server in out, f"{case}: the error does not name {server}: {out[-600:]}"
    assert PASSWORD not in out


def test_a_rabbitmq_that_never_answers_is_reported_not_waited_on_silently(
    service_env: dict[str, str], silent_port: int
) -> None:
    """SKED_RABBITMQ_URL pointing at a port that accepts the connection and never answers
    (a blackholed broker, a wrong port). The relay should, within 20 s, either exit non-zero
    or at least log a line naming RabbitMQ. It said nothing and waited for ever:
    aio_pika.connect_robust has no timeout of its own (Postgres silent the same way: 60 s,
    then a traceback of an empty TimeoutError). Now a start waits CONNECT_S (10 s) for each
    server's first answer, then exits 1 naming it."""
    env = {**service_env, "SKED_RABBITMQ_URL": f"amqp://guest:guest@127.0.0.1:{silent_port}/x"}
    proc = _start(env, "relay")
    code, out = _finish(proc, timeout=20)
    said = [line for line in out.splitlines() if "rabbitmq" in line.lower() or "amqp" in line]
    assert code not in (None, 0) or said, (
        f"the relay is still starting after 20 s and said nothing of RabbitMQ: {out[-600:]!r}"
    )


# -- settings that pass and then break the service ----------------------------------------------


@pytest.mark.parametrize(
    ("service", "var", "ready"),
    [
        ("api", "SKED_API_HOST", "api listening"),
        ("heartbeat-monitor", "SKED_MONITOR_HOST", "heartbeat-monitor listening"),
    ],
)
def test_an_empty_listen_host_does_not_open_the_service_on_every_interface(
    service_env: dict[str, str], service: str, var: str, ready: str
) -> None:
    """SKED_API_HOST= (or SKED_MONITOR_HOST=) set but empty, as a blank ConfigMap value or
    `VAR=` in an env file leaves it. It should be refused naming the variable (or mean the
    default, 127.0.0.1). Settings took "" (whitespace too), aiohttp passed it to
    create_server, and "" there means every interface: the operator API / the heartbeat
    endpoint listened on 0.0.0.0 and [::]. Now a blank host is refused, naming it."""
    env = {**service_env, var: "", "SKED_API_PORT": "0", "SKED_MONITOR_PORT": "0"}
    proc = _start(env, service)
    try:
        assert proc.stderr is not None
        fd = proc.stderr.fileno()
        os.set_blocking(fd, False)

        def more() -> str:
            try:
                return os.read(fd, 65536).decode(errors="replace")
            except BlockingIOError:
                return ""

        seen, deadline = "", time.monotonic() + 20
        while ready not in seen and proc.poll() is None and time.monotonic() < deadline:
            seen += more()
            time.sleep(0.1)
        if proc.poll() is not None:  # refused at start: it must say which variable
            seen += more()
            assert proc.returncode != 0, seen[-600:]
            assert var in seen, seen[-600:]
            return
        assert ready in seen, f"{service} neither refused nor got ready: {seen[-600:]}"
        wildcard = [a for a in _listening(proc.pid) if set(a) == {"0"}]
        assert not wildcard, f"{var}='' made {service} listen on every interface: {seen[-300:]}"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        _finish(proc, timeout=15)


def test_a_dead_letter_bound_past_what_amqp_encodes_is_refused_naming_it(
    service_env: dict[str, str],
) -> None:
    """SKED_DEAD_MAX_MESSAGES=99999999999999999999999 (or SKED_DEAD_MAX_BYTES): Settings
    took any int >= 1, and the scheduler crashed declaring sked.dead with a traceback
    through pamqp (`x-max-length error: Unsupported numeric value`, no variable named): an
    AMQP table holds at most a signed 64-bit integer. Now both are bounded by it."""
    env = {**service_env, "SKED_DEAD_MAX_MESSAGES": "99999999999999999999999"}
    code, out = _finish(_start(env, "scheduler"), timeout=30)
    assert code not in (None, 0), out[-600:]
    assert "Traceback" not in out, out[-1200:]
    assert "SKED_DEAD_MAX_MESSAGES" in out, out[-600:]


def test_sked_status_reads_the_same_database_as_every_other_command(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SKED_DATABASE_URL and sked_database_url both set (a compose env file beside a shell
    export), to different databases. `quick` (what `sked status` reads: services/cli/
    remote.py:103) claims to match the name 'as Settings matches it', and should give the same
    URL as Settings. It took the FIRST match in os.environ while pydantic-settings keeps the
    LAST: `sked status` read one database and every other command another. Now the last."""
    monkeypatch.setenv("SKED_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/sked_one")
    monkeypatch.setenv("sked_database_url", "postgresql://postgres@127.0.0.1:5432/sked_two")
    assert quick("DATABASE_URL") == Settings().database_url
