"""The Kubernetes backend as the backend tests run it: on a fake cluster (tests/fakes/kube.py),
namespace `NS`, a start budget of a second, a node grace of half a second."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from services.executor.backends import Launch, Outcome
from services.executor.backends.kubernetes import KubernetesBackend
from services.executor.backends.kubernetes.kube import Kube, api_client
from services.executor.backends.kubernetes.launch import MemoryBook
from services.executor.backends.kubernetes.manifest import JobOptions, job_name
from tests.fakes.kube import FakeCluster

NS = "sked-jobs"


@contextlib.asynccontextmanager
async def on_cluster(cluster: FakeCluster) -> AsyncIterator[KubernetesBackend]:
    """A started backend talking to `cluster` over HTTP, closed on the way out."""
    api = await api_client(None, host=cluster.url)
    backend = KubernetesBackend(
        Kube(api, NS),
        MemoryBook(),
        JobOptions(NS, ttl_s=60),
        start_budget_s=1.0,
        relist_s=30,
        node_grace_s=0.5,
    )
    await backend.start()
    try:
        yield backend
    finally:
        await backend.close()


async def run(backend: KubernetesBackend, what: Launch, timeout: float = 15) -> Outcome:
    """One attempt through the backend, to its outcome, bounded."""
    async with asyncio.timeout(timeout):
        return await backend.run(what)


def job_of(what: Launch) -> str:
    """The name of the attempt's Job."""
    return job_name(what.task_id, what.attempt)
