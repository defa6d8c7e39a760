"""The producer SDK for code without an event loop: SkedClient's calls, each run to its end on
a private loop.

    from sked import SyncSkedClient

    with SyncSkedClient() as sked:
        task = sked.wait(sked.submit({"name": "hello", "job": {"kind": "command",
                                                             "argv": ["echo", "hi"]}}))
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Coroutine, Iterable, Sequence
from typing import Any, TypeVar
from uuid import UUID

from shared.client import SkedClient
from shared.errors import SkedError
from shared.models import Event, Task, TaskSpec
from shared.settings import Settings

T = TypeVar("T")


class SyncSkedClient:
    """The same calls for code without an event loop: each runs on a private loop
    (asyncio.Runner: Ctrl-C cancels the call, and closing cancels what is left, so that no
    connection is cut off mid-way). Threads may share one client: its calls take turns, and
    `close()` from another thread ends a call in progress. A client does not cross a fork:
    the child shares its connections with the parent, so there it refuses every call, and
    closing it leaves them to the parent."""

    def __init__(self, settings: Settings | None = None) -> None:
        self._runner: asyncio.Runner | None = asyncio.Runner()
        self._client = SkedClient(settings)
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._closed = False
        self._call: asyncio.Task[Any] | None = None  # the call in progress, for close()
        self._caller: int | None = None  # the thread running it

    def submit(self, spec: TaskSpec | dict[str, Any]) -> UUID:
        return self._run(self._client.submit(spec))

    def submit_many(self, specs: Sequence[TaskSpec | dict[str, Any]]) -> list[UUID]:
        return self._run(self._client.submit_many(specs))

    def get(self, task_id: UUID | str) -> Task:
        return self._run(self._client.get(task_id))

    def history(self, task_id: UUID | str) -> list[Event]:
        return self._run(self._client.history(task_id))

    def tasks(
        self,
        statuses: Iterable[object] | None = None,
        limit: int = 100,
        after: UUID | None = None,
        name: str | None = None,
    ) -> list[Task]:
        return self._run(self._client.tasks(statuses, limit, after, name))

    def wait(self, task_id: UUID | str, timeout: float | None = None) -> Task:
        return self._run(self._client.wait(task_id, timeout))

    def pause(self, task_id: UUID | str, reason: str, by: str | None = None) -> Task:
        return self._run(self._client.pause(task_id, reason, by))

    def resume(self, task_id: UUID | str) -> Task:
        return self._run(self._client.resume(task_id))

    def cancel(self, task_id: UUID | str, reason: str = "", by: str | None = None) -> Task:
        return self._run(self._client.cancel(task_id, reason, by))

    def pause_workflow(
        self, workflow_id: UUID | str, reason: str, by: str | None = None
    ) -> list[Task]:
        return self._run(self._client.pause_workflow(workflow_id, reason, by))

    def resume_workflow(self, workflow_id: UUID | str, by: str | None = None) -> list[Task]:
        return self._run(self._client.resume_workflow(workflow_id, by))

    def cancel_workflow(
        self, workflow_id: UUID | str, reason: str = "", by: str | None = None
    ) -> list[Task]:
        return self._run(self._client.cancel_workflow(workflow_id, reason, by))

    def set_priority(self, task_id: UUID | str, priority: int) -> list[Task]:
        return self._run(self._client.set_priority(task_id, priority))

    def wait_all(
        self, task_ids: Iterable[UUID | str], timeout: float | None = None
    ) -> dict[UUID, Task]:
        return self._run(self._client.wait_all(task_ids, timeout))

    def close(self) -> None:
        """Close the client and its loop, ending a call another thread has in progress (it
        raises SkedError); closing again does nothing."""
        self._closed = True
        if self._pid != os.getpid():
            return  # a forked child's copy: the connections are the parent's to close
        call = self._call
        if call is not None:
            call.get_loop().call_soon_threadsafe(call.cancel)
        if self._caller == threading.get_ident():
            # called from within a call on this thread (a signal handler: `signal.signal(
            # SIGTERM, lambda *_: sked.close())`): waiting for the lock would wait for itself;
            # the call, canceled, shuts the client when it unwinds (_run)
            return
        with self._lock:
            self._shut()

    def _shut(self) -> None:
        runner, self._runner = self._runner, None
        if runner is None:
            return
        try:
            runner.run(self._client.close())
        finally:
            runner.close()

    def _run(self, call: Coroutine[Any, Any, T]) -> T:
        """One call, to its end, on the private loop: one at a time (two threads sharing the
        client take turns; a loop runs one call at once), never after close."""
        why = self._unusable()
        if why is not None:
            call.close()
            raise SkedError(why)
        with self._lock:
            runner = self._runner
            if runner is None or self._closed:
                call.close()
                raise SkedError("the client is closed")
            self._caller = threading.get_ident()
            try:
                return runner.run(self._tracked(call))
            except asyncio.CancelledError:
                if self._closed:
                    raise SkedError("the client is closed") from None
                raise
            finally:
                self._call = self._caller = None
                if self._closed:  # closed during the call, from within it
                    self._shut()

    async def _tracked(self, call: Coroutine[Any, Any, T]) -> T:
        self._call = asyncio.current_task()
        if self._closed:  # close() came before the call could be seen: it cancels nothing
            call.close()
            raise SkedError("the client is closed")
        return await call

    def _unusable(self) -> str | None:
        if self._pid != os.getpid():
            return "this SyncSkedClient was made before a fork: make one in this process"
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return None
        return "SyncSkedClient is for code without an event loop: in a coroutine, use SkedClient"

    def __enter__(self) -> SyncSkedClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
