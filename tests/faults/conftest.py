"""The fault-injection suite: whole deployments as processes, with things killed for real.

Every case records a row (case, tasks, lost, duplicated, recovery seconds); the table is
printed at the end of the run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.e2e.conftest import Deployment, client, deployment

ROWS: list[Row] = []


@dataclass
class Row:
    case: str
    tasks: int
    lost: int
    duplicated: int
    recovery_s: float | None
    # seconds during which two attempts of one task had running processes (None: not measured)
    overlap_s: float | None = None


@pytest.fixture
def record() -> list[Row]:
    return ROWS


@pytest.fixture
def stamps(tmp_path: Path) -> Path:
    d = tmp_path / "stamps"
    d.mkdir()
    return d


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not ROWS:
        return
    tr = terminalreporter
    tr.section("fault injection")
    tr.write_line(
        f"{'case':<62} {'tasks':>6} {'lost':>5} {'dup':>5} {'overlap s':>10} {'recovery s':>11}"
    )
    for r in ROWS:
        rec = "-" if r.recovery_s is None else f"{r.recovery_s:.2f}"
        over = "-" if r.overlap_s is None else f"{r.overlap_s:.2f}"
        tr.write_line(
            f"{r.case:<62} {r.tasks:>6} {r.lost:>5} {r.duplicated:>5} {over:>10} {rec:>11}"
        )


__all__ = ["Deployment", "Row", "client", "deployment"]
