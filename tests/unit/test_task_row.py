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
