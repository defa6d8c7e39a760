"""Launching an attempt's Job: fenced, idempotent, recorded; and its inputs' Secret.

Fenced: every older attempt's Job of the task is deleted and its pods confirmed gone first.
Idempotent: a create answered 5xx or cut off is tried again and then meets its own Job (409),
which is adopted only when its labels name this attempt and its uid is the recorded one, if
any — a stranger's object is never adopted by name alone. Recorded: the uid, so that the Job
of a launched attempt is never created again.

A workflow task's inputs go in a Secret made after its Job (owned by it: collected with it),
before the uid is recorded: a recorded launch has its inputs. Its pod waits for the Secret to
start; a Secret that cannot be made deletes the Job, and the launch fails.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol
from uuid import UUID

from pydantic_core import to_json

from services.executor.backends import Key, Launch, NodeOffer
from services.executor.backends.kubernetes.kube import (
    Kube,
    KubeError,
    Obj,
    delete_job_patiently,
    name_of,
)
from services.executor.backends.kubernetes.manifest import (
    DIGEST,
    INCARNATION,
    MAX_SECRET_BYTES,
    TASK_LABEL,
    JobOptions,
    inputs_secret,
    job_manifest,
    key_of,
)
from shared.errors import one_line
from shared.models import CommandJob, Resources

log = logging.getLogger(__name__)

CREATE_TRIES = 5  # a create answered 5xx or cut off is tried again (and then meets its Job)
# a workflow task's inputs, as JSON, in a variable as well as in $SKED_INPUTS while they are
# small (the variable came first; a large one would crowd what execve() takes)
INPUTS_ENV = "SKED_INPUTS_JSON"
INPUTS_ENV_BYTES = 64 * 1024
# what etcd answers (through the API server, as a 500) for an object over --max-request-bytes
ETCD_TOO_LARGE = "request is too large"


class LaunchBook(Protocol):
    """Where the uid of each attempt's Job is recorded (Postgres: shared.store.launches)."""

    async def recorded(self, task_id: UUID, attempt: int) -> str | None: ...
    async def record(self, task_id: UUID, attempt: int, name: str, uid: str) -> None: ...


class MemoryBook:
    """A LaunchBook for one process (tests of the backend alone)."""

    def __init__(self) -> None:
        self.uids: dict[Key, str] = {}

    async def recorded(self, task_id: UUID, attempt: int) -> str | None:
        return self.uids.get((task_id, attempt))

    async def record(self, task_id: UUID, attempt: int, name: str, uid: str) -> None:
        self.uids[(task_id, attempt)] = uid


class LaunchFailed(Exception):
    def __init__(self, why: str, permanent: bool = False) -> None:
        super().__init__(why)
        self.permanent = permanent


class Launcher:
    def __init__(
        self,
        kube: Kube,
        book: LaunchBook,
        options: JobOptions,
        offers: Callable[[], Mapping[str, NodeOffer]],
        start_budget_s: float,
        pods_changed: asyncio.Event,
    ) -> None:
        self.kube = kube
        self.book = book
        self.options = options
        self.offers = offers
        self.start_budget_s = start_budget_s
        self._pods_changed = pods_changed

    async def launch(
        self, launch: Launch, job: CommandJob, stopped: Callable[[], bool] = lambda: False
    ) -> None:
        """Create the attempt's Job once: fenced, idempotent, recorded. A create is not tried
        once `stopped()` (the attempt was stopped meanwhile: it would run on)."""
        task_id, attempt = launch.task_id, launch.attempt
        await self._fence(task_id, attempt)
        node = self.offers().get(launch.node or "")
        if node is None:
            raise LaunchFailed(f"node {launch.node} is not a node of this cluster (any more)")
        # measured as sked measures them everywhere (dag.inputs_too_large): compact UTF-8
        inputs = None if launch.inputs is None else to_json(launch.inputs)
        if inputs is not None and len(inputs) > MAX_SECRET_BYTES:
            raise LaunchFailed(
                f"the task's inputs are {len(inputs)} bytes of JSON; a Kubernetes Secret, "
                f"which carries them to the Job, holds at most {MAX_SECRET_BYTES}",
                permanent=True,
            )

        def manifest(env: Mapping[str, str]) -> dict[str, Any]:
            return job_manifest(
                task_id,
                attempt,
                node.id,
                node.hostname or node.id,
                job,
                launch.resources or Resources(),
                env,
                launch.timeout_s,
                self.options,
                launch.incarnation,
                inputs,
            )

        small = inputs is not None and len(inputs) <= INPUTS_ENV_BYTES
        variable = {INPUTS_ENV: inputs.decode()} if small and inputs is not None else {}
        try:
            try:
                body = manifest({**launch.env, **variable})
            except ValueError:
                if not variable:
                    raise
                # what execve() takes, exceeded with the variable: the file has the inputs
                body = manifest(launch.env)
        except ValueError as exc:
            raise LaunchFailed(str(exc), permanent=True) from None
        created = await self._create(body, task_id, attempt, stopped)
        if inputs is not None:
            await self._give_inputs(created, inputs, stopped)
        await self.book.record(task_id, attempt, name_of(created), uid_of(created))

    async def _create(
        self, body: Mapping[str, Any], task_id: UUID, attempt: int, stopped: Callable[[], bool]
    ) -> Obj:
        async def adopt() -> Obj | None:  # None: an earlier incarnation's Job, deleted
            return await self._adopt(body, task_id, attempt)

        return await self._create_patiently("Job", body, self.kube.create_job, adopt, stopped)

    async def _give_inputs(self, job: Obj, data: bytes, stopped: Callable[[], bool]) -> None:
        """Make the Secret of the attempt's inputs, owned by its `job`. One of the name already
        there (a create whose answer was lost, or left by another) is deleted and made anew
        (the pod mounts only a Secret holding its inputs' hash as a key: job_manifest). A
        Secret not made, or a stop meanwhile, deletes the Job: its pod would otherwise wait
        for the Secret until the start budget ran out, or start once it came."""
        name = name_of(job)

        async def clear() -> None:
            await self.kube.delete_secret(name)

        body = inputs_secret(job, data)
        try:
            await self._create_patiently("Secret", body, self.kube.create_secret, clear, stopped)
        except Exception:
            await delete_job_patiently(self.kube, name)
            raise

    async def _create_patiently(
        self,
        kind: str,
        body: Mapping[str, Any],
        create: Callable[[Mapping[str, Any]], Awaitable[Obj]],
        conflict: Callable[[], Awaitable[Obj | None]],
        stopped: Callable[[], bool],
    ) -> Obj:
        """`create(body)`, tried again after an outage (5xx, cut off) and given up on a refusal
        that would come every time (`_refusal`). On 409 `conflict()` says what was met: the
        object to take, or None to create again. Not tried once `stopped()`."""
        name = body["metadata"]["name"]
        pause, why = 0.2, "it kept meeting one of its name"
        for tries in range(1, CREATE_TRIES + 1):
            if stopped():
                raise LaunchFailed(f"stopped before its {kind} was created")
            try:
                try:
                    return await create(body)
                except KubeError as exc:
                    if exc.status != 409:
                        raise
                if (found := await conflict()) is not None:
                    return found
                continue
            except KubeError as exc:
                if (refused := _refusal(kind, body, exc)) is not None:
                    raise refused from None
                why = str(exc)
            except (OSError, TimeoutError) as exc:
                why = one_line(exc)
            if tries < CREATE_TRIES:
                log.warning("creating %s %s failed (%s); trying again", kind, name, why)
                await asyncio.sleep(pause)
                pause = min(pause * 2, 2.0)
        raise LaunchFailed(f"{kind} not created after {CREATE_TRIES} tries: {why}")

    async def _adopt(self, body: Mapping[str, Any], task_id: UUID, attempt: int) -> Obj | None:
        """A Job by this attempt's name exists: ours only if its labels say so, it was made
        from this very spec (its digest annotation: labels anyone may copy), and its uid is
        the recorded one, when one is: a stranger's object is never adopted by name alone.

        One of an earlier task of this id (a key reused after retention: its incarnation
        annotation differs, and its record went with that task) is deleted, its pods awaited
        (they carry this attempt's labels), and None returned: the caller creates anew."""
        name = body["metadata"]["name"]
        found = await self.kube.get_job(name)
        if found is None:
            raise LaunchFailed(f"Job {name} answered 409 but is gone")
        earlier = _annotation(found, INCARNATION)
        if key_of(found) == (task_id, attempt) and earlier not in (
            None,
            _annotation(body, INCARNATION),
        ):
            log.info("Job %s is of an earlier task of this id (%s): deleted", name, earlier)
            await delete_job_patiently(self.kube, name)
            await self._until_gone(str(task_id), lambda key: key == (task_id, attempt))
            return None
        recorded = await self.book.recorded(task_id, attempt)
        ours = key_of(found) == (task_id, attempt) and _annotation(found) == _annotation(body)
        ours = ours and earlier == _annotation(body, INCARNATION)
        if not ours or (recorded and recorded != uid_of(found)):
            raise LaunchFailed(f"a Job named {name} exists and is not this attempt's", True)
        log.info("Job %s existed already (a create whose answer was lost): adopted", name)
        return found

    async def _fence(self, task_id: UUID, attempt: int) -> None:
        """Delete every older attempt's Job of this task and wait until their pods are gone."""
        selector = f"{TASK_LABEL}={task_id}"
        jobs, _ = await self.kube.jobs(selector)
        for old in jobs:
            key = key_of(old)
            if key is not None and key[1] < attempt:
                await self.kube.delete_job(name_of(old))
        await self._until_gone(str(task_id), lambda key: key[1] < attempt)

    async def _until_gone(self, task_id: str, doomed: Callable[[Key], bool]) -> None:
        """Wait until no pod of the task whose key is `doomed` is left (those nothing owns
        deleted here), within the start budget."""
        selector = f"{TASK_LABEL}={task_id}"
        deadline = time.monotonic() + self.start_budget_s
        while True:
            pods, _ = await self.kube.pods(selector)
            older = [p for p in pods if (k := key_of(p)) is not None and doomed(k)]
            if not older:
                return
            for orphan in [p for p in older if not _owners(p)]:
                # its Job deleted with the Orphan policy: nothing collects it, so this does
                await self.kube.delete_pod(name_of(orphan))
            if time.monotonic() > deadline:
                raise LaunchFailed(f"pods of an earlier attempt still present: {name_of(older[0])}")
            self._pods_changed.clear()
            try:  # woken by the pod informer; re-listed at least every second regardless
                async with asyncio.timeout(1.0):
                    await self._pods_changed.wait()
            except TimeoutError:
                pass


def _refusal(kind: str, body: Mapping[str, Any], exc: KubeError) -> LaunchFailed | None:
    """What an answer the same request meets every time means: an invalid object or a refusal
    (permanent, but for 403: RBAC can be mended), or an object too large (not an outage)."""
    if exc.status in (400, 403, 422):
        return LaunchFailed(f"{kind} refused: {exc}", permanent=exc.status != 403)
    if exc.status == 413 or (exc.status == 500 and ETCD_TOO_LARGE in exc.body):
        return LaunchFailed(
            f"{kind} refused as too large ({body_size(body)} bytes; the API server takes at "
            f"most 3 MiB per request, etcd 1.5 MiB by default): {exc}",
            permanent=True,
        )
    return None


def body_size(body: Mapping[str, Any]) -> int:
    """The bytes of a request body, as JSON (about what the client sends)."""
    return len(json.dumps(body, separators=(",", ":")).encode())


def uid_of(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("uid") or "")


def owned_by(obj: Mapping[str, Any], uid: str) -> bool:
    """Whether `obj` (a pod) names the object of `uid` (its Job) among its owners."""
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return any(ref.get("uid") == uid for ref in refs)


def _owners(obj: Mapping[str, Any]) -> list[Any]:
    return list((obj.get("metadata") or {}).get("ownerReferences") or [])


def _annotation(obj: Mapping[str, Any], name: str = DIGEST) -> str | None:
    value = ((obj.get("metadata") or {}).get("annotations") or {}).get(name)
    return None if value is None else str(value)
