"""Task.from_row: a row of the task's columns (and only those) becomes a Task; a statement's
own extra columns are ignored; a row lacking a column is refused, naming it."""

from __future__ import annotations

import pytest

from shared.fsm import State
from shared.task import Task
from tests.helpers import task_row as _row


def test_a_row_of_exactly_the_columns() -> None:
    row = _row()
    task = Task.from_row(row)
    assert task.status is State.READY
    assert task.version == 3
    assert task.id == row["id"]
    assert Task.from_row(row) == task


def test_extra_columns_are_ignored() -> None:
    row = {**_row(), "_fenced": True, "_notified": 1}
    task = Task.from_row(row)
    assert not hasattr(task, "_fenced")
    assert not hasattr(task, "_notified")
    assert task.id == row["id"]
    assert task.version == 3


def test_defaulted_columns_may_be_absent() -> None:
    row = _row()
    del row["launch_failures"], row["inputs"]
    task = Task.from_row(row)
    assert task.launch_failures == 0
    assert task.inputs is None


@pytest.mark.parametrize("extra", [False, True])
def test_a_missing_column_is_named(extra: bool) -> None:
    row = _row()
    del row["version"]
    if extra:
        row["_fenced"] = False  # as many keys as a whole row: still refused
    with pytest.raises(TypeError, match="version"):
        Task.from_row(row)


def test_rows_of_one_statement_read_as_each_alone() -> None:
    """Task.from_rows reads a statement's columns once: each task is what from_row makes of
    its row, whether the rows are exactly a task's columns, carry the statement's own, or
    lack defaulted ones; a missing column is refused there too."""
    exact = [_row(), {**_row(), "status": "running", "version": 4}]
    extra = [{**row, "_notified": 1} for row in exact]
    short = [dict(row) for row in exact]
    for row in short:
        del row["launch_failures"]
    for rows in (exact, extra, short):
        tasks = Task.from_rows(rows)
        assert tasks == [Task.from_row(row) for row in rows]
        assert [t.status for t in tasks] == [State.READY, State.RUNNING]
        assert not any(hasattr(t, "_notified") for t in tasks)
    assert Task.from_rows([]) == []
    broken = [dict(row) for row in exact]
    for row in broken:
        del row["version"]
    with pytest.raises(TypeError, match="version"):
        Task.from_rows(broken)
