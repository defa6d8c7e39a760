"""Which client the CLI's read and control commands use: the operator API when SKED_API_URL and
SKED_API_TOKEN are both set (shared.api_client: HTTP, a bearer token, no database access
needed), else the SDK straight to Postgres, Redis and RabbitMQ. Both have these calls."""

from __future__ import annotations

from collections.abc import Iterable
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol
from uuid import UUID

from shared.errors import SkedError

if TYPE_CHECKING:  # each client is imported when chosen: the other's libraries never load
    from shared.api_client import ApiClient
    from shared.dag import WorkflowSpec
    from shared.dead_letters import DeadLetter
    from shared.models import Event, Task, TaskSpec
    from shared.settings import Settings
    from shared.store import NodeRow
    from shared.views import WorkflowSummary, WorkflowView


class Client(Protocol):
    async def __aenter__(self) -> Client: ...
    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...
    async def submit(self, spec: TaskSpec | dict[str, Any]) -> UUID: ...
    async def submit_workflow(self, spec: WorkflowSpec | dict[str, Any]) -> UUID: ...
    async def get(self, task_id: UUID | str) -> Task: ...
    async def tasks(
        self,
        statuses: Iterable[object] | None = None,
        limit: int = 100,
        after: UUID | None = None,
        name: str | None = None,
    ) -> list[Task]: ...
    async def history(self, task_id: UUID | str) -> list[Event]: ...
    async def workflows(
        self, limit: int = 100, after: UUID | None = None, name: str | None = None
    ) -> list[WorkflowSummary]: ...
    async def log(self, task_id: UUID | str, timeout: float = 5.0) -> str | None: ...
    async def workflow(self, workflow_id: UUID | str) -> WorkflowView: ...
    async def nodes(self) -> list[NodeRow]: ...
    async def dead_letters(self, limit: int = 100) -> list[DeadLetter]: ...
    async def pause(self, task_id: UUID | str, reason: str, by: str | None = None) -> Task: ...
    async def resume(self, task_id: UUID | str, by: str | None = None) -> Task: ...
    async def cancel(
        self, task_id: UUID | str, reason: str = "", by: str | None = None
    ) -> Task: ...
    async def pause_workflow(
        self, workflow_id: UUID | str, reason: str, by: str | None = None
    ) -> list[Task]: ...
    async def resume_workflow(
        self, workflow_id: UUID | str, by: str | None = None
    ) -> list[Task]: ...
    async def cancel_workflow(
        self, workflow_id: UUID | str, reason: str = "", by: str | None = None
    ) -> list[Task]: ...
    async def set_priority(self, task_id: UUID | str, priority: int) -> list[Task]: ...
    async def wait(self, task_id: UUID | str, timeout: float | None = None) -> Task: ...
    async def wait_all(
        self, task_ids: Iterable[UUID | str], timeout: float | None = None
    ) -> dict[UUID, Task]: ...
    async def wait_workflow(
        self, workflow_id: UUID | str, timeout: float | None = None
    ) -> WorkflowView: ...


def api(settings: Settings) -> ApiClient | None:
    """The API client when the CLI is configured for the API, else None."""
    if settings.api_url and settings.api_token:
        from shared.api_client import ApiClient

        return ApiClient(settings.api_url, settings.api_token)
    if settings.api_url or settings.api_token:
        raise SkedError(
            "set both SKED_API_URL and SKED_API_TOKEN to go through the API, or neither"
        )
    return None


def connect(settings: Settings | None = None) -> Client:
    from shared.settings import Settings

    s = settings or Settings()
    remote = api(s)
    if remote is not None:
        return remote
    from shared.client import SkedClient

    return SkedClient(s)


def straight_to_postgres() -> str | None:
    """The database URL when the CLI reads Postgres itself (no operator API configured), read
    without building the settings (shared.settings.quick); None when it goes through the API."""
    from shared.settings import DEFAULT_DATABASE_URL, quick

    if quick("API_URL") or quick("API_TOKEN"):
        return None  # connect() decides, and says what is missing
    return quick("DATABASE_URL") or DEFAULT_DATABASE_URL
