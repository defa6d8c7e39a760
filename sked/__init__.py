"""sked's public API for producers and operators' scripts:

    from sked import SkedClient, TaskSpec, State

    async with SkedClient() as sked:              # reads SKED_* like every sked process
        task_id = await sked.submit({"name": "hi", "job": {"kind": "command", "argv": ["true"]}})
        task = await sked.wait(task_id)
        assert task.status is State.SUCCESS

Everything here is stable across minor versions; what is not here (shared.*, services.*) is
sked's inside and may change.
"""

from __future__ import annotations

from shared.client import SkedClient, WaitTimeout
from shared.dag import WorkflowSpec
from shared.errors import (
    IllegalTransition,
    InvalidSpec,
    NotAllowed,
    NotFound,
    SkedError,
    StaleWrite,
)
from shared.fsm import State
from shared.models import CommandJob, Event, HandlerJob, Resources, Task, TaskSpec
from shared.sync_client import SyncSkedClient
from shared.views import WorkflowView

__all__ = [
    "CommandJob",
    "Event",
    "HandlerJob",
    "IllegalTransition",
    "InvalidSpec",
    "NotAllowed",
    "NotFound",
    "Resources",
    "SkedClient",
    "SkedError",
    "StaleWrite",
    "State",
    "SyncSkedClient",
    "Task",
    "TaskSpec",
    "WaitTimeout",
    "WorkflowSpec",
    "WorkflowView",
]
