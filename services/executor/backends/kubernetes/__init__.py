"""The Kubernetes backend: each attempt runs as one Job on the cluster node sked placed it on.

One executor with this backend serves a cluster (or a node pool): it offers every schedulable
Ready node matching its selector to placement (`offers`), and several replicas may serve one
cluster — an attempt is claimed in Postgres before its Job is created (claim-before-start),
its Job's name is fixed by task and attempt, and a create that meets an existing Job adopts it
only when its labels name the same attempt and its uid is the one recorded, if any.

The loss ladder (brief §6) runs here, for the attempts this executor follows: a node that
turned NotReady gets a grace; then the Job's and pod's status are read (an attempt that ended
is reported as it ended); then the log's freshness (did it grow over the grace?); only then is
the attempt reported lost, each rung named in the reason. Its lease is renewed meanwhile: the
heartbeat-monitor judges only attempts whose executor went quiet.

At most one live attempt: before attempt N's Job is created, every older attempt's Job of the
task is deleted and its pods are confirmed gone. A Job recorded as launched is never created
again: if it vanishes, the attempt is lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from uuid import UUID

from services.executor.backends import Key, Launch, NodeOffer, Outcome
from services.executor.backends.kubernetes.kube import (
    API_TROUBLE,
    Informer,
    Kube,
    KubeError,
    Obj,
    cancel,
    delete_job_patiently,
    get_job_patiently,
    name_of,
    patiently,
)
from services.executor.backends.kubernetes.launch import (
    LaunchBook,
    Launcher,
    LaunchFailed,
    owned_by,
    uid_of,
)
from services.executor.backends.kubernetes.manifest import (
    NODE_LABEL,
    SELECTOR,
    TASK_LABEL,
    JobOptions,
    job_name,
    key_of,
    node_offer,
    node_ready,
)
from services.executor.backends.kubernetes.status import Verdict, exited, judge, latest
from shared.errors import one_line
from shared.models import CommandJob

log = logging.getLogger(__name__)

LOG_TAIL_CHARS = 64 * 1024


@dataclass
class Followed:
    """An attempt this executor follows: its Job, and what it has seen of it."""

    name: str
    node: str = ""
    since: float = field(default_factory=time.monotonic)  # created or adopted (start budget)
    started: float | None = None  # monotonic time the container was first seen running
    stopped: bool = False
    stopped_at: float = 0.0
    last_log: str = ""  # read when it was stopped (its pod may be gone when it ends)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    # the loss ladder's last rung: the log as read when its node was seen NotReady, and when
    log_mark: str | None = None
    log_at: float = 0.0


class KubernetesBackend:
    detached = True  # a Job runs on without its executor

    def __init__(
        self,
        kube: Kube,
        book: LaunchBook,
        options: JobOptions,
        node_selector: str = "",
        start_budget_s: float = 300.0,
        relist_s: float = 60.0,
        node_grace_s: float = 40.0,
    ) -> None:
        self.node_grace_s = node_grace_s
        self.not_ready_since: dict[str, float] = {}  # node -> monotonic time it turned so
        self.kube = kube
        self.book = book
        self.options = options
        self.start_budget_s = start_budget_s
        self.reaped: list[Key] = []
        self.followed: dict[Key, Followed] = {}
        self.offers_changed = asyncio.Event()
        self.jobs = Informer(kube, "jobs", SELECTOR, relist_s, self._on_job)
        self.pods = Informer(kube, "pods", SELECTOR, relist_s, self._on_pod)
        self.nodes = Informer(kube, "nodes", node_selector, relist_s, self._on_node)
        self._tasks: list[asyncio.Task[None]] = []
        self._pods_changed = asyncio.Event()
        self.launcher = Launcher(
            kube, book, options, self.offers, start_budget_s, self._pods_changed
        )

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        informers = (self.jobs, self.pods, self.nodes)
        self._tasks = [asyncio.create_task(i.run(), name=f"k8s {i.kind}") for i in informers]
        async with asyncio.timeout(30):  # the API must answer a first list to start at all
            for informer in informers:
                await informer.synced.wait()

    async def watch(self) -> None:
        """Informers never give up (they list again); one that ended is a bug: raise."""
        done, _ = await asyncio.wait(self._tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            task.result()
        raise RuntimeError("a Kubernetes informer stopped")

    async def close(self) -> None:
        await cancel(self._tasks)
        await self.kube.api.close()

    # -- nodes -----------------------------------------------------------------------------

    def offers(self) -> dict[str, NodeOffer]:
        found = (node_offer(n) for n in self.nodes.objects.values())
        return {o.id: o for o in found if o is not None}

    def _on_node(self, name: str, obj: Obj | None) -> None:
        if obj is not None and node_ready(obj):
            self.not_ready_since.pop(name, None)
        else:
            self.not_ready_since.setdefault(name, time.monotonic())
        for followed in self.followed.values():
            if followed.node == name:
                followed.changed.set()
        self.offers_changed.set()

    # -- running ---------------------------------------------------------------------------

    def running(self) -> set[Key]:
        return set(self.followed)

    def renew(self, key: Key, seconds: float) -> None:
        """A Job runs on without its executor; the lease is enforced at the next launch, which
        deletes the older attempt's Job and waits for its pods to be gone."""

    def frozen(self, key: Key) -> bool:
        return False

    async def run(self, launch: Launch) -> Outcome:
        key = (launch.task_id, launch.attempt)
        job = launch.job
        if not isinstance(job, CommandJob) or not job.image:
            return Outcome.failed(
                "the kubernetes backend runs command jobs with job.image set", final=True
            )
        name = job_name(*key)
        followed = self.followed[key] = Followed(name, launch.node or "")
        try:
            uid = await self.book.recorded(*key)
            if uid is not None:  # launched before (a redelivered dispatch): never created twice
                return await self._follow_recorded(key, followed, uid, launch.timeout_s)
            try:
                await self.launcher.launch(launch, job, lambda: followed.stopped)
            except LaunchFailed as exc:
                if followed.stopped:  # stopped before its Job was made: nothing runs
                    return Outcome.halted("")
                return Outcome.launch_failed(str(exc), final=exc.permanent)
            except API_TROUBLE as exc:  # a next attempt's fence deletes what this one left
                return Outcome.launch_failed(f"Kubernetes API: {one_line(exc)}")
            if followed.stopped:  # a stop whose delete came before the create: delete it now
                await delete_job_patiently(self.kube, name)
            return await self._follow(key, followed, launch.timeout_s)
        finally:
            self.followed.pop(key, None)

    def adoptable(self) -> set[Key]:
        """Every attempt with a Job in the cluster: one this executor did not start (its
        executor restarted, or is gone) is followed here once adopted."""
        return {k for j in self.jobs.objects.values() if (k := key_of(j)) is not None}

    async def follow(self, key: Key, timeout_s: float | None) -> Outcome:
        """Follow an adopted attempt's Job to its outcome (the run timer restarts here)."""
        name = job_name(*key)
        labels = (self.jobs.objects.get(name) or {}).get("metadata", {}).get("labels") or {}
        followed = self.followed[key] = Followed(name, str(labels.get(NODE_LABEL, "")))
        try:
            uid = await self.book.recorded(*key)
            return await self._follow_recorded(key, followed, uid, timeout_s)
        finally:
            self.followed.pop(key, None)

    async def _follow_recorded(
        self, key: Key, followed: Followed, uid: str | None, timeout_s: float | None
    ) -> Outcome:
        found = await get_job_patiently(self.kube, followed.name)
        if found is None or (uid is not None and uid_of(found) != uid):
            # the Job of a launched attempt vanished (or was replaced by a stranger): a loss
            return Outcome.gone("its Job was launched and has vanished")
        return await self._follow(key, followed, timeout_s)

    async def _follow(self, key: Key, followed: Followed, timeout_s: float | None) -> Outcome:
        while True:
            verdict = self.verdict(key)
            if followed.stopped and verdict.kind != "exited":
                # stopped: it ends once its pods are gone (or, should they linger past the
                # start budget, with them still terminating: the next attempt's fence waits)
                lingering = time.monotonic() - followed.stopped_at < self.start_budget_s
                if not self._has_pods(key) or not lingering:
                    return Outcome.halted(followed.last_log)
            elif verdict.kind == "exited":
                if verdict.exit_code == 0 and verdict.message is None:
                    # a Complete Job before its pod's status reached the cache (two watches,
                    # in no order): the API says what the pod's message is, or that it is gone
                    job = self.jobs.objects.get(followed.name)
                    fresh = judge(job, await self._fresh_pods(key), 0, self.start_budget_s)
                    verdict = fresh if fresh.kind == "exited" else verdict
                return exited(verdict, await self._log(key), key)
            elif verdict.kind == "deadline":  # it ran: a timeout, not a launch failure
                return Outcome.failed(verdict.reason, await self._log(key), timed_out=True)
            elif verdict.kind == "lost":
                if followed.name not in self.jobs.objects:
                    # the cache may lag the API (a create not yet watched, a list taken before
                    # it): a Job is gone only when the API says so
                    found = await get_job_patiently(self.kube, followed.name)
                    if found is not None:
                        self.jobs.objects.setdefault(followed.name, found)
                        continue
                return Outcome.gone(verdict.reason, await self._log(key))
            elif verdict.kind == "launch_failed":
                await delete_job_patiently(self.kube, followed.name)
                return Outcome.launch_failed(verdict.reason, final=verdict.permanent)
            else:
                if verdict.kind == "running" and followed.started is None:
                    followed.started = time.monotonic()
                lost = await self._ladder(key, followed)
                if lost is not None:
                    return lost
            wait = self._next_look(followed, timeout_s)
            if wait is not None and wait <= 0:  # sked's run timer, from the container's start
                tail = await self._log(key)  # before the delete: then its pod goes
                await delete_job_patiently(self.kube, followed.name)
                return Outcome.failed(
                    f"ran past its timeout of {timeout_s:g} s", tail, timed_out=True
                )
            followed.changed.clear()
            try:
                async with asyncio.timeout(wait):
                    await followed.changed.wait()
            except TimeoutError:
                pass

    def _next_look(self, followed: Followed, timeout_s: float | None) -> float | None:
        """Seconds until the next deadline (run timer, start budget, the ladder's grace);
        None: none."""
        now = time.monotonic()
        looks: list[float] = []
        if followed.started is not None:
            if timeout_s is not None:
                looks.append(followed.started + timeout_s - now)
        elif followed.stopped:
            looks.append(1.0)
        else:
            looks.append(max(0.05, followed.since + self.start_budget_s - now))
        if followed.log_mark is not None:
            looks.append(max(0.05, followed.log_at + self.node_grace_s - now))
        return min(looks, default=None)

    async def _ladder(self, key: Key, followed: Followed) -> Outcome | None:
        """The loss ladder for an attempt whose node is not Ready: Lost (the rungs named in
        the reason) once the grace is spent, the Job and pod still say nothing of an end, and
        the log has not grown over the grace; None while any rung holds."""
        since = self.not_ready_since.get(followed.node)
        if since is None:
            followed.log_mark = None
            return None
        now = time.monotonic()
        if followed.log_mark is None:
            followed.log_mark, followed.log_at = await self._log(key), now
            return None
        if now - followed.log_at < self.node_grace_s:
            return None
        rungs = [
            f"node {followed.node} NotReady for {now - since:.0f} s (grace {self.node_grace_s:g} s)"
        ]
        # the Job's and pod's status, read afresh from the API rather than from the cache
        job = await get_job_patiently(self.kube, followed.name)
        fresh = judge(job, await self._fresh_pods(key), now - followed.since, self.start_budget_s)
        if fresh.kind in ("exited", "launch_failed"):
            return None  # it did end, on its own: the cache catches up and it is reported so
        rungs.append(f"Job and pod: {fresh.kind}{f' ({fresh.reason})' if fresh.reason else ''}")
        tail = await self._log(key)
        if tail != followed.log_mark:
            followed.log_mark, followed.log_at = tail, now  # it still writes: alive
            return None
        rungs.append(f"log unchanged for {now - followed.log_at:.0f} s")
        log.warning("%s attempt %d lost: %s", key[0], key[1], "; ".join(rungs))
        return Outcome.gone("; ".join(rungs), tail)

    async def _fresh_pods(self, key: Key) -> list[Obj]:
        """The attempt's pods as the API lists them now, not as the cache has them (owned by
        its Job while the Job is known, as in `_pods_of`)."""
        listed, _ = await patiently(
            lambda: self.kube.pods(f"{TASK_LABEL}={key[0]}"), f"list pods of task {key[0]}"
        )
        job = self.jobs.objects.get(job_name(*key))
        return [p for p in listed if key_of(p) == key and (not job or owned_by(p, uid_of(job)))]

    def verdict(self, key: Key) -> Verdict:
        followed = self.followed.get(key)
        name = followed.name if followed else job_name(*key)
        waited = time.monotonic() - followed.since if followed else 0.0
        started = followed is not None and followed.started is not None
        job = self.jobs.objects.get(name)
        return judge(job, self._pods_of(key), waited, self.start_budget_s, started)

    def _pods_of(self, key: Key) -> list[Obj]:
        """The attempt's pods: labelled so, and owned by its Job while the Job is known — a
        copy keeping sked's labels (`kubectl debug --copy-to`) decides nothing."""
        pods = [p for p in self.pods.objects.values() if key_of(p) == key]
        job = self.jobs.objects.get(job_name(*key))
        return pods if job is None else [p for p in pods if owned_by(p, uid_of(job))]

    def _has_pods(self, key: Key) -> bool:
        return bool(self._pods_of(key))

    async def log_tail(self, key: Key, limit: int) -> str | None:
        """The pod's log as it is now (the newest pod of the attempt's Job)."""
        if latest(self._pods_of(key)) is None:
            return None
        return (await self._log(key))[-limit:]

    async def prune(self, older_than_s: float, keep: AbstractSet[Key]) -> int:
        return 0  # nothing kept here: a Job and its pods' logs go by their TTL (SKED_K8S_JOB_TTL_S)

    async def _log(self, key: Key) -> str:
        pod = latest(self._pods_of(key))
        if pod is None:
            return ""
        try:
            return await self.kube.pod_log(name_of(pod), LOG_TAIL_CHARS)
        except (KubeError, OSError, TimeoutError) as exc:
            return f"(log not readable: {one_line(exc)})"

    async def discard(self, keys: set[Key]) -> None:
        """Delete the Jobs of these superseded attempts (and, Background, their pods)."""
        for key in keys - set(self.followed):
            with contextlib.suppress(*API_TROUBLE):
                if await self.kube.delete_job(job_name(*key)):
                    log.info("deleted the Job of %s attempt %d: the task moved on", *key)

    async def stop_task(self, task_id: UUID, attempt: int) -> bool:
        """Delete the attempt's Job (and pods); its run() returns once the pods are gone."""
        followed = self.followed.get((task_id, attempt))
        if followed is None:
            return False
        followed.stopped, followed.stopped_at = True, time.monotonic()
        # its log read beside the delete, not before it: a log that does not answer (the
        # node unreachable) must not hold the delete back
        reading = asyncio.create_task(self._log((task_id, attempt)))
        try:  # the watch loop calls this: bounded; the next attempt's fence deletes it anyway
            async with asyncio.timeout(10):
                await delete_job_patiently(self.kube, followed.name)
        except TimeoutError:
            log.warning("Job %s not deleted yet (the API does not answer)", followed.name)
        followed.last_log = await reading  # bounded by the log's own read timeout
        followed.changed.set()
        return True

    # -- informer callbacks ----------------------------------------------------------------

    def _wake(self, obj: Obj | None, name: str) -> None:
        key = key_of(obj) if obj is not None else None
        for k, followed in self.followed.items():
            if k == key or followed.name == name or name.startswith(followed.name + "-"):
                followed.changed.set()

    def _on_job(self, name: str, obj: Obj | None) -> None:
        self._wake(obj, name)

    def _on_pod(self, name: str, obj: Obj | None) -> None:
        self._pods_changed.set()
        self._wake(obj, name)
