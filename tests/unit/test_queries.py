"""The SQL fragments that must agree with each other."""

from __future__ import annotations

import re

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
    assert "CASE WHEN k.keep THEN spec::text END AS spec_json" in thin
