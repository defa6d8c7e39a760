"""`sked` starts fast: parsing a command, and the modules `sked status` runs, import neither
RabbitMQ's client nor OpenTelemetry (nor the other heavy libraries) until a command needs them.

Each check runs in a fresh interpreter (`python -c`): this process has imported them already.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

NEVER = {"opentelemetry", "aio_pika", "aiormq"}  # never for reading a task
HEAVY = NEVER | {"redis", "aiohttp", "prometheus_client", "kubernetes_asyncio", "yaml", "uvloop"}

TASK_ID = "8da55d00-60d6-4b20-bac2-b0bf303bfd81"


def loaded(code: str, env: dict[str, str] | None = None) -> set[str]:
    """The top-level packages in sys.modules after running `code` in a fresh interpreter."""
    tops = "sorted({m.split('.')[0] for m in sys.modules})"
    probe = f"{code}\nimport json, sys\nprint(json.dumps({tops}))"
    done = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return set(json.loads(done.stdout.splitlines()[-1]))


def test_parsing_a_command_imports_nothing_heavy() -> None:
    found = loaded(
        f"from services.cli import build_parser\nbuild_parser().parse_args(['status', '{TASK_ID}'])"
    )
    assert found & HEAVY == set()
    assert found & {"asyncpg", "pydantic", "pydantic_settings"} == set()  # not even those


def test_the_status_command_and_its_clients_import_no_bus_or_tracing() -> None:
    """What `sked status` imports before it connects: the command module, the client it picks
    (the SDK, or the API client with SKED_API_URL) and the settings."""
    found = loaded("import services.cli.commands, shared.client, shared.api_client")
    assert found & (HEAVY - {"aiohttp"}) == set()  # aiohttp: the API client's HTTP
    assert "asyncpg" not in found  # the store loads when the SDK first reads


STATUS = (
    "from services.cli import main\n"
    "try:\n"
    f"    code = main(['status', '{TASK_ID}'])\n"
    "except OSError:\n"
    "    code = None\n"
)
NOWHERE = {"PATH": "/usr/bin:/bin", "SKED_DATABASE_URL": "postgresql://nobody@127.0.0.1:1/none"}


def test_running_status_imports_no_bus_or_tracing() -> None:
    """The whole command, up to its connection (refused here: nothing listens on port 1).
    Refused by libpq, it tries asyncpg too, which says why it failed."""
    found = loaded(STATUS + "assert code == 2, code\n", NOWHERE)
    assert found & NEVER == set()
    # straight to Postgres, a task is read without the settings model or the spec's models
    assert found & {"pydantic", "pydantic_settings"} == set()


def test_status_through_libpq_loads_neither_asyncio_nor_asyncpg() -> None:
    """Connected through libpq (to a database without sked's tables: the query fails, a
    clear error, exit 2), the command never loads asyncio or asyncpg. (The test command
    installs libpq where it is missing, as a deployment's image does.)"""
    admin = os.environ.get("SKED_TEST_PG_ADMIN", "postgresql://postgres@127.0.0.1:5432/postgres")
    found = loaded(STATUS + "assert code == 2, code\n", {**NOWHERE, "SKED_DATABASE_URL": admin})
    assert "ctypes" in found
    assert found & {"asyncio", "asyncpg"} == set()
    assert found & NEVER == set()


def test_without_libpq_status_reads_through_asyncpg() -> None:
    """Where libpq cannot be loaded the command falls back to asyncpg, and a database not
    there is still a clear error (exit 2)."""
    hide = "import shared.store.libpq as pq\npq._NAMES = ('libpq-not-here.so.0',)\n"
    probe = hide + STATUS + "assert code == 2, code\n"
    found = loaded(probe, NOWHERE)
    assert "asyncpg" in found
    assert found & NEVER == set()


def test_the_token_parser_offers_every_role() -> None:
    from services.cli.tokens import ROLES
    from shared.auth import Role

    assert list(ROLES) == [r.value for r in Role]


def test_a_database_not_there_is_a_clear_error_not_a_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from services.cli import main

    monkeypatch.delenv("SKED_API_URL", raising=False)
    monkeypatch.delenv("SKED_API_TOKEN", raising=False)
    monkeypatch.setenv("SKED_DATABASE_URL", "postgresql://nobody@127.0.0.1:1/none")
    assert main(["status", TASK_ID]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sked: ")
    assert "Traceback" not in err
