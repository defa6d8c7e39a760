"""The SQL fragments that must agree with each other."""

from __future__ import annotations

import re

from shared import hooks
from shared.store.queries import Q
from shared.task import Task


def _aliases(columns: str) -> list[str]:
    """The names a select list gives its columns, in order."""
    names = []
    for column in re.split(r",\s*", columns.strip()):
        found = re.search(r"(?:AS\s+)?(\w+)$", column.strip())
        assert found is not None, column
        names.append(found.group(1))
    return names


def test_the_thin_transition_reads_back_the_columns_of_a_task_in_order() -> None:
    """`transition_thin` (moves wanting no row back) names the columns `transition` does, in
    their order, so a row it returns whole is a Task as any other read gives it."""
    full = Q.transition.sql.split("FROM sked_transition")[0].removeprefix("SELECT")
    thin = Q.transition_thin.sql.split("FROM sked_transition")[0].removeprefix("SELECT")
    assert _aliases(thin) == _aliases(full)
    assert set(_aliases(full)) == set(Task.__dataclass_fields__)
    assert "CASE WHEN k.level >= 2 THEN spec::text END AS spec_json" in thin


def test_a_row_read_back_for_the_hooks_holds_what_they_read() -> None:
    """Level 1 of task_columns_at (a move not read back, with a hook installed) names exactly
    hooks.SEEN: the columns read at level 0 or 1."""
    thin = Q.transition_thin.sql.split("FROM sked_transition")[0].removeprefix("SELECT")
    columns = [c.strip() for c in re.split(r",\s*\n", thin.strip())]
    at_most_1 = {_aliases(c)[0] for c in columns if not c.startswith("CASE") or ">= 1 THEN" in c}
    assert at_most_1 == hooks.SEEN
    assert all(c.startswith("CASE WHEN k.level >= ") or " " not in c for c in columns)


def test_the_hooks_read_only_what_a_thin_row_holds() -> None:
    """The hooks sked installs read, of a moved task, only columns in hooks.SEEN (the names
    they use as `task.<column>` in their `transitions`)."""
    import inspect

    from shared import metrics, telemetry

    used: set[str] = set()
    for source in (
        inspect.getsource(metrics.MetricsHook.transitions),
        inspect.getsource(telemetry.transitions),
    ):
        used |= set(re.findall(r"\btask\.(\w+)", source))
    assert used, "the hooks read no task column: this test reads the wrong code"
    assert used <= hooks.SEEN, used - hooks.SEEN
