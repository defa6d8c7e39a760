"""An operator's words are checked before any state changes: a reason or a name that Postgres
could not store (a NUL, a lone surrogate) or that is longer than a note is refused with
InvalidSpec naming the field, and the task, the node and the degrade mode stay as they were."""

from __future__ import annotations

from uuid import uuid4

import pytest

from shared import control, cordon, modes
from shared.alerts import Alerter
from shared.degrade import Mode
from shared.errors import InvalidSpec
from shared.jsonvalue import MAX_NOTE
from shared.store import Store
from tests.helpers import spec

BAD = [("a\x00b", "NUL"), ("\ud800", "surrogate"), ("x" * (MAX_NOTE + 1), "at most")]


async def test_a_reason_postgres_cannot_store_changes_nothing(store: Store) -> None:
    task = await store.tasks.create(spec("t"))
    await store.nodes.register("n1", 1, 1.0, 64, 0, {}, uuid4())
    degrade = await store.degrade.read()
    alerter = Alerter(None, None)
    for text, says in BAD:
        with pytest.raises(InvalidSpec, match=f"reason holds .*{says}"):
            await control.pause(store, task.id, text)
        with pytest.raises(InvalidSpec, match=f"by holds .*{says}"):
            await control.cancel(store, None, task.id, "fine", by=text)
        with pytest.raises(InvalidSpec, match=f"by holds .*{says}"):
            await control.resume(store, None, task.id, by=text)
        with pytest.raises(InvalidSpec, match=f"reason holds .*{says}"):
            await control.cancel_workflow(store, None, uuid4(), text)
        with pytest.raises(InvalidSpec, match=f"by holds .*{says}"):
            await control.pause_workflow(store, None, uuid4(), "fine", by=text)
        with pytest.raises(InvalidSpec, match=f"by holds .*{says}"):
            await control.resume_workflow(store, None, uuid4(), by=text)  # type: ignore[arg-type]
        with pytest.raises(InvalidSpec, match=f"reason holds .*{says}"):
            await cordon.cordon(store, "n1", "ops", text)
        with pytest.raises(InvalidSpec, match=f"reason holds .*{says}"):
            await modes.change(store.degrade, Mode.FULL, text, "ops", None, None, alerter)
    assert (await store.tasks.get(task.id)).version == task.version
    assert (await store.nodes.all())[0].cordoned_at is None
    assert await store.degrade.read() == degrade
    await control.pause(store, task.id, "x" * MAX_NOTE)  # a long note that fits is kept
