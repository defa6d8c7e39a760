"""The Kubernetes API as sked uses it: wire dicts in and out, and informers (list + watch +
periodic re-list) that keep a cache of Jobs, pods and nodes.

Every call goes through kubernetes-asyncio with `_preload_content=False`: objects stay the
API's own camelCase JSON (what the pure modules judge), a pod log that happens to be JSON is
not turned into a Python repr, and errors are checked here. The watch is read here too rather
than with `kubernetes_asyncio.watch.Watch`, which retries a 410 with the same stale version and
does not survive a dropped connection: after any error or 410 an informer lists afresh.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
from kubernetes_asyncio import client, config

from shared.errors import one_line

log = logging.getLogger(__name__)

Obj = dict[str, Any]


class KubeError(Exception):
    def __init__(self, status: int, body: str) -> None:
        self.status = status
        self.body = body
        try:
            message = json.loads(body).get("message") or body
        except (ValueError, AttributeError):
            message = body
        super().__init__(f"HTTP {status}: {' '.join(str(message).split())[:300]}")


async def api_client(
    kubeconfig: Path | None, context: str | None = None, host: str | None = None
) -> client.ApiClient:
    """An ApiClient from a kubeconfig, the in-cluster service account, or a bare `host` (the
    fake API server of the tests)."""
    cfg = client.Configuration()
    if host is not None:
        cfg.host = host
    elif kubeconfig is not None:
        await config.load_kube_config(
            config_file=str(kubeconfig), context=context, client_configuration=cfg
        )
    else:
        config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
    return client.ApiClient(cfg)


LOG_READ_S = 5.0  # the longest a pod's log is waited for


class Kube:
    """Jobs and pods in one namespace, and the cluster's nodes."""

    def __init__(self, api: client.ApiClient, namespace: str) -> None:
        self.api = api
        self.namespace = namespace
        self.batch = client.BatchV1Api(api)
        self.core = client.CoreV1Api(api)

    @staticmethod
    async def _read(pending: Awaitable[Any]) -> bytes:
        resp = await pending
        try:
            body: bytes = await resp.read()
            if not 200 <= resp.status <= 299:
                raise KubeError(resp.status, body.decode("utf-8", "replace"))
            return body
        finally:
            resp.release()

    async def _json(self, pending: Awaitable[Any]) -> Obj:
        data: Obj = json.loads(await self._read(pending))
        return data

    async def create_job(self, body: Mapping[str, Any]) -> Obj:
        return await self._json(
            self.batch.create_namespaced_job(
                self.namespace,
                dict(body),  # type: ignore[arg-type]  # a dict is sent as it is
                _preload_content=False,
            )
        )

    async def get_job(self, name: str) -> Obj | None:
        try:
            return await self._json(
                self.batch.read_namespaced_job(name, self.namespace, _preload_content=False)
            )
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    async def _delete(self, pending: Awaitable[Any]) -> bool:
        """A delete's answer: True if it deleted, False if the object was gone (404)."""
        try:
            await self._read(pending)
        except KubeError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    async def delete_job(self, name: str) -> bool:
        """Delete a Job and (Background propagation) its pods and Secret; False if gone."""
        return await self._delete(
            self.batch.delete_namespaced_job(
                name,
                self.namespace,
                propagation_policy="Background",  # the API's default leaves the pods
                _preload_content=False,
            )
        )

    async def create_secret(self, body: Mapping[str, Any]) -> Obj:
        return await self._json(
            self.core.create_namespaced_secret(
                self.namespace,
                dict(body),  # type: ignore[arg-type]  # a dict is sent as it is
                _preload_content=False,
            )
        )

    async def delete_secret(self, name: str) -> bool:
        """Delete a Secret; False if it was gone."""
        return await self._delete(
            self.core.delete_namespaced_secret(name, self.namespace, _preload_content=False)
        )

    async def delete_pod(self, name: str) -> bool:
        """Delete a pod; False if it was gone."""
        return await self._delete(
            self.core.delete_namespaced_pod(name, self.namespace, _preload_content=False)
        )

    async def jobs(self, selector: str) -> tuple[list[Obj], str]:
        got = await self._json(
            self.batch.list_namespaced_job(
                self.namespace, label_selector=selector, _preload_content=False
            )
        )
        return _items(got)

    async def pods(self, selector: str) -> tuple[list[Obj], str]:
        got = await self._json(
            self.core.list_namespaced_pod(
                self.namespace, label_selector=selector, _preload_content=False
            )
        )
        return _items(got)

    async def nodes(self, selector: str) -> tuple[list[Obj], str]:
        got = await self._json(self.core.list_node(label_selector=selector, _preload_content=False))
        return _items(got)

    async def pod_log(self, name: str, limit: int) -> str:
        """The end of a pod's log (at most `limit` characters), '' if it has none. Bounded:
        in bytes (a line may be any length: limitBytes keeps a few lines of gigabytes out of
        the executor's memory) and in time (the API server's proxy to an unreachable node
        hangs: LOG_READ_S)."""
        try:
            async with asyncio.timeout(LOG_READ_S):
                body = await self._read(
                    self.core.read_namespaced_pod_log(
                        name,
                        self.namespace,
                        tail_lines=2000,
                        limit_bytes=4 * limit,  # UTF-8: at most four bytes a character
                        _preload_content=False,
                    )
                )
        except KubeError as exc:
            if exc.status in (400, 404):  # not started, or gone
                return ""
            raise
        return body.decode("utf-8", "replace")[-limit:]

    def lister(self, kind: str) -> Callable[..., Awaitable[Any]]:
        return {
            "jobs": lambda **kw: self.batch.list_namespaced_job(self.namespace, **kw),
            "pods": lambda **kw: self.core.list_namespaced_pod(self.namespace, **kw),
            "nodes": lambda **kw: self.core.list_node(**kw),
        }[kind]

    async def watch(
        self, kind: str, selector: str, version: str, timeout_s: float
    ) -> AsyncIterator[tuple[str, Obj]]:
        """Events of `kind` after `version` until the server ends the stream. A 410 (or any
        ERROR event) ends it with KubeError: the caller lists afresh."""
        resp = await self.lister(kind)(
            label_selector=selector,
            watch=True,
            resource_version=version,
            timeout_seconds=max(1, int(timeout_s)),
            _preload_content=False,
        )
        try:
            if not 200 <= resp.status <= 299:
                raise KubeError(resp.status, (await resp.read()).decode("utf-8", "replace"))
            buffer = b""
            # lines are split here: aiohttp's readline refuses lines over 64 KiB
            async for chunk in resp.content.iter_any():
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    if not line.strip():
                        continue
                    event = json.loads(line)
                    obj = event.get("object") or {}
                    if event.get("type") == "ERROR":
                        raise KubeError(int(obj.get("code") or 500), json.dumps(obj))
                    yield str(event.get("type")), obj
        finally:
            resp.release()


def _items(listed: Obj) -> tuple[list[Obj], str]:
    version = str((listed.get("metadata") or {}).get("resourceVersion") or "")
    return list(listed.get("items") or []), version


def name_of(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("name") or "")


class Informer:
    """A cache of one kind of object, kept by list + watch, re-listed after a 410, a dropped
    or failed watch, and every `relist_s` whatever happens (a watch alone is never trusted).
    `on_change(name, obj or None)` is called for every object that changed or went away."""

    def __init__(
        self,
        kube: Kube,
        kind: str,
        selector: str,
        relist_s: float,
        on_change: Callable[[str, Obj | None], None],
    ) -> None:
        self.kube = kube
        self.kind = kind
        self.selector = selector
        self.relist_s = relist_s
        self.on_change = on_change
        self.objects: dict[str, Obj] = {}
        self.synced = asyncio.Event()
        self.lists = 0  # how many times it listed (tests read it)

    async def run(self) -> None:
        pause = 0.2
        while True:
            try:
                version = await self.relist()
                pause = 0.2
                until = time.monotonic() + self.relist_s
                while (left := until - time.monotonic()) > 0:
                    # a server that ignores timeoutSeconds must not hold the stream forever
                    async with asyncio.timeout(left + 1):
                        async for kind, obj in self.kube.watch(
                            self.kind, self.selector, version, left
                        ):
                            version = self._apply(kind, obj) or version
                    # the stream ended (timeout, or the server closed it): watch on from here
            except asyncio.CancelledError:
                raise
            except TimeoutError:
                continue  # time to re-list
            except Exception as exc:  # 410, a dropped connection, the API away: list afresh
                log.info("%s watch ended (%s); listing again", self.kind, one_line(exc))
                await asyncio.sleep(pause)
                pause = min(pause * 2, 5.0)

    async def relist(self) -> str:
        items, version = await {
            "jobs": self.kube.jobs,
            "pods": self.kube.pods,
            "nodes": self.kube.nodes,
        }[self.kind](self.selector)
        self.lists += 1
        fresh = {name_of(o): o for o in items}
        gone = set(self.objects) - set(fresh)
        self.objects = fresh
        for name in gone:
            self.on_change(name, None)
        for name, obj in fresh.items():
            self.on_change(name, obj)
        self.synced.set()
        return version

    def _apply(self, kind: str, obj: Obj) -> str | None:
        name = name_of(obj)
        if kind == "BOOKMARK" or not name:
            return _version(obj)
        if kind == "DELETED":
            self.objects.pop(name, None)
            self.on_change(name, None)
        else:
            self.objects[name] = obj
            self.on_change(name, obj)
        return _version(obj)


def _version(obj: Mapping[str, Any]) -> str | None:
    version = (obj.get("metadata") or {}).get("resourceVersion")
    return str(version) if version else None


async def cancel(tasks: list[asyncio.Task[None]]) -> None:
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


# What the API or the network may do to any call; none of it is the task's fault.
API_TROUBLE = (KubeError, OSError, aiohttp.ClientError, TimeoutError, ValueError)
T = TypeVar("T")


# A refusal of the executor's credentials (401, 403) is no outage: nothing changes until an
# operator grants the permission. It is still retried (the attempt is followed once they do),
# but slowly, and said as an error naming the fix, once a minute per call rather than a warning
# every 5 s that reads like a passing outage.
REFUSED_PAUSE_S = 5.0
REFUSED_SAY_EVERY = 12  # tries between two errors about one call: a minute at REFUSED_PAUSE_S


async def patiently(call: Callable[[], Awaitable[T]], what: str = "Kubernetes API") -> T:
    """`call()` until it answers: an attempt is followed through an API outage, not given up
    (the executor's shutdown cancels it)."""
    pause, refusals = 0.2, 0
    while True:
        try:
            return await call()
        except API_TROUBLE as exc:
            if isinstance(exc, KubeError) and exc.status in (401, 403):
                if refusals % REFUSED_SAY_EVERY == 0:
                    log.error(
                        "%s: %s: the executor's Kubernetes credentials may not do this (its"
                        " service account's Role: deploy/kubernetes/rbac.yaml); trying again"
                        " every %.0f s until they may",
                        what,
                        one_line(exc),
                        REFUSED_PAUSE_S,
                    )
                refusals += 1
                await asyncio.sleep(REFUSED_PAUSE_S)
                continue
            log.warning("%s: %s; trying again in %.1f s", what, one_line(exc), pause)
            await asyncio.sleep(pause)
            pause = min(pause * 2, 5.0)


async def get_job_patiently(kube: Kube, name: str) -> Obj | None:
    return await patiently(lambda: kube.get_job(name), f"get job {name}")


async def delete_job_patiently(kube: Kube, name: str) -> bool:
    return await patiently(lambda: kube.delete_job(name), f"delete job {name}")
