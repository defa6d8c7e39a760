"""The SDK's operator controls (shared.control: pause, resume, cancel, priority, whole
workflows; shared.modes: degrade), as SkedClient's methods: it supplies the store, the ready
queue and the bus."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING
from uuid import UUID

from shared.errors import one_line
from shared.redact import masked

if TYPE_CHECKING:
    from shared.bus import AmqpBus
    from shared.degrade import DegradeState, Mode
    from shared.models import Task
    from shared.queues import ReadyQueue
    from shared.settings import Settings
    from shared.store import Store

log = logging.getLogger(__name__)


class Control:
    settings: Settings

    async def _db(self) -> Store:
        raise NotImplementedError

    async def _publisher(self) -> AmqpBus:
        raise NotImplementedError

    def _queue(self) -> ReadyQueue:
        raise NotImplementedError

    async def pause(self, task_id: UUID | str, reason: str, by: str | None = None) -> Task:
        """Pause a non-terminal task (a running attempt is stopped). Raises NotAllowed."""
        from shared import control

        return await control.pause(await self._db(), UUID(str(task_id)), reason, by)

    async def resume(self, task_id: UUID | str, by: str | None = None) -> Task:
        """Resume a paused task: it runs again as a new attempt, with no retry spent."""
        from shared import control

        return await control.resume(await self._db(), self._queue(), UUID(str(task_id)), by)

    async def cancel(self, task_id: UUID | str, reason: str = "", by: str | None = None) -> Task:
        """Cancel a non-terminal task (a running attempt is stopped). Raises NotAllowed."""
        from shared import control

        return await control.cancel(await self._db(), self._queue(), UUID(str(task_id)), reason, by)

    async def cancel_workflow(
        self, wf: UUID | str, reason: str = "", by: str | None = None
    ) -> list[Task]:
        """Cancel every task of a workflow not ended yet; returns them. Raises NotAllowed."""
        from shared import control

        return await control.cancel_workflow(
            await self._db(), self._queue(), UUID(str(wf)), reason, by
        )

    async def pause_workflow(
        self, wf: UUID | str, reason: str, by: str | None = None
    ) -> list[Task]:
        """Pause every task of a workflow not ended yet; returns them. Raises NotAllowed."""
        from shared import control

        return await control.pause_workflow(
            await self._db(), self._queue(), UUID(str(wf)), reason, by
        )

    async def resume_workflow(self, wf: UUID | str, by: str | None = None) -> list[Task]:
        """Resume every paused task of a workflow; returns them. Raises NotAllowed."""
        from shared import control

        return await control.resume_workflow(await self._db(), self._queue(), UUID(str(wf)), by)

    async def set_priority(self, task_id: UUID | str, priority: int) -> list[Task]:
        """Change a non-terminal task's priority (a workflow task's upstreams inherit it).
        Returns the tasks whose priority changed, this one first. Raises NotAllowed."""
        from shared import control

        store = await self._db()
        return await control.set_priority(store, self._queue(), UUID(str(task_id)), priority)

    async def degrade_status(self) -> DegradeState:
        """The degrade mode every scheduler obeys."""
        return await (await self._db()).degrade.read()

    async def degrade(
        self, mode: Mode, reason: str, by: str, for_s: float | None = None
    ) -> DegradeState:
        """Set the degrade mode (NORMAL lifts it) for `for_s` seconds or until lifted; its
        event and alert go out (without RabbitMQ: its alert only). Raises ModeChanged if it
        changed meanwhile."""
        from shared import modes
        from shared.alerts import Alerter

        modes.check_duration(for_s)  # before connecting anywhere
        bus: AmqpBus | None
        try:
            bus = await self._publisher()
        except Exception as exc:
            if not _away(exc):
                raise  # RabbitMQ refused (no such vhost, bad credentials): configuration
            # the mode is a Postgres row the schedulers obey; its event is a courtesy, and
            # an outage is when an operator may most want to hold dispatch back
            log.error(
                "RabbitMQ not reached (%s): the degrade mode is set, but no scheduler.degrade "
                "event goes out",
                masked(one_line(exc)),
            )
            bus = None
        alerter = Alerter(bus, self.settings.alertmanager_url)
        try:
            store = await self._db()
            _, after = await modes.change(store.degrade, mode, reason, by, for_s, bus, alerter)
        finally:
            await alerter.close()
        return after


def _away(exc: BaseException) -> bool:
    """Whether RabbitMQ could not be reached (refused, unresolvable, timed out), as opposed
    to answering with a refusal: an OS-level error in the chain that is not AMQP's own."""
    import aiormq

    seen: BaseException | None = exc
    for _ in range(8):  # a chain is short; never loop on a cycle
        if seen is None:
            return False
        if isinstance(seen, OSError) and not isinstance(seen, aiormq.exceptions.AMQPError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False
