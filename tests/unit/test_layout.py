"""The layout the architecture promises (docs/architecture.md, "Where to find what"), checked:
SQL only in the store, a pure core, services that do not import each other, an executor that
knows only the Backend protocol, modules small enough to read in one sitting."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCTION = [
    p
    for package in ("sked", "shared", "services")
    for p in (ROOT / package).rglob("*.py")
    if "__pycache__" not in p.parts
]
SQL = re.compile(
    r"\b(SELECT\s+[\w*(]|INSERT\s+INTO|UPDATE\s+\w+\s+SET|DELETE\s+FROM|CREATE\s+(TABLE|INDEX))"
)
SERVICES = ["scheduler", "executor", "heartbeat_monitor", "recovery", "relay", "api"]
PURE = ["fsm", "models", "task", "dag", "placement", "backoff", "outcome", "heartbeat", "intake",
        "degrade", "jsonvalue", "lease", "policy", "outbox_pack", "errors", "auth"]  # fmt: skip
IO = {"asyncpg", "redis", "aio_pika", "aiormq", "aiohttp"}


def imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text("utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def strings(path: Path) -> list[str]:
    return [
        n.value
        for n in ast.walk(ast.parse(path.read_text("utf-8")))
        if isinstance(n, ast.Constant) and isinstance(n.value, str)
    ]


def test_no_sql_outside_the_store() -> None:
    store = ROOT / "shared" / "store"
    offenders = [
        f"{p.relative_to(ROOT)}: {s[:60]!r}"
        for p in PRODUCTION
        if store not in p.parents
        for s in strings(p)
        if SQL.search(s)
    ]
    assert offenders == []


def test_no_service_imports_another() -> None:
    for name in SERVICES:
        others = {f"services.{o}" for o in SERVICES if o != name}
        for path in (ROOT / "services" / name).rglob("*.py"):
            bad = {i for i in imports(path) if any(i.startswith(o) for o in others)}
            assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_the_executor_knows_only_the_backend_protocol() -> None:
    executor = ROOT / "services" / "executor"
    for path in executor.glob("*.py"):
        if path.name == "__main__.py":  # the wiring chooses the backend
            continue
        bad = {i for i in imports(path) if i.startswith("services.executor.backends.")}
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_the_core_is_pure() -> None:
    for name in PURE:
        path = ROOT / "shared" / f"{name}.py"
        bad = {i for i in imports(path) if i.split(".")[0] in IO or i.startswith("shared.store")}
        assert not bad, f"shared/{name}.py imports {bad}"


def test_modules_are_small_enough_to_read_in_one_sitting() -> None:
    long = {
        str(p.relative_to(ROOT)): n
        for p in PRODUCTION
        if (n := len(p.read_text("utf-8").splitlines())) > 400
    }
    assert long == {}
