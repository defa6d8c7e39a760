"""sked on a (fake) Kubernetes cluster, end to end: the services as processes, the executor with
--backend kubernetes pointed at a fake API server (tests/fakes/kube.py) whose driver creates each
Job's pod and walks it through the scenario the task's command names."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any
from uuid import UUID

import kubernetes_validate
import pytest

from services.executor.backends.kubernetes.manifest import job_name
from shared.client import SkedClient
from shared.errors import NotFound
from shared.fsm import State
from shared.models import Task
from tests.e2e.conftest import Deployment
from tests.fakes.kube import (
    FakeCluster,
    ImageNotFound,
    ImagePullBackOff,
    RunUntilDeleted,
    Scenario,
    Succeed,
    Unschedulable,
    fake_cluster,
)
from tests.helpers import ServiceProcess, eventually

pytestmark = pytest.mark.slow

INPUTS = "/var/run/sked/inputs.json"
SCENARIOS: dict[str, Scenario] = {
    "ok": Succeed(after_s=0.2, log="done\n"),
    # a workflow's two ends: one declares an output, the other hands on what its inputs held
    "extract": Succeed(after_s=0.1, message='{"rows": 41}'),
    "report": Succeed(after_s=0.1, message=lambda files: files[INPUTS]),
    "slow": Succeed(after_s=4.0, log="slow done\n"),
    "forever": RunUntilDeleted(log="working\n"),
    "pull": ImagePullBackOff(),
    "stuck": Unschedulable(),
    "missing": ImageNotFound(),
}


def scenario(job: dict[str, Any]) -> Scenario:
    command = job["spec"]["template"]["spec"]["containers"][0]["command"]
    return SCENARIOS[command[0]]


# Tests take `cluster` before `deployment`: the services stop before the fake API server does.
@pytest.fixture
async def cluster() -> AsyncIterator[FakeCluster]:
    async with fake_cluster(scenario) as c:
        c.add_node("cpu-a", cpu="4", memory="8Gi", labels={"pool": "cpu"})
        c.add_node("cpu-b", cpu="4", memory="8Gi", labels={"pool": "cpu"})
        c.add_node("gpu-1", cpu="8", memory="32Gi", gpu=2, labels={"pool": "gpu"})
        yield c


async def start(
    deployment: Deployment, cluster: FakeCluster, name: str = "kx", budget_s: float = 15
) -> ServiceProcess:
    env = {
        "SKED_K8S_API_URL": cluster.url,
        "SKED_K8S_NAMESPACE": "sked-jobs",
        "SKED_K8S_START_BUDGET_S": str(budget_s),
        "SKED_K8S_NODE_GRACE_S": "1",
    }
    return await deployment.start(
        "executor",
        "--node-id",
        name,
        "--backend",
        "kubernetes",
        env=env,
        ready=f"executor {name} ready",
    )


async def services(
    deployment: Deployment, cluster: FakeCluster, budget_s: float = 15
) -> ServiceProcess:
    for name in ("scheduler", "relay", "recovery"):
        await deployment.start(name)
    await deployment.start("heartbeat-monitor", "--port", "0")  # pods send it no beats here
    return await start(deployment, cluster, budget_s=budget_s)


def task(command: str, **kw: Any) -> dict[str, Any]:
    return {"name": command, "job": {"kind": "command", "argv": [command], "image": "app:1"}, **kw}


async def get(client: SkedClient, task_id: UUID) -> Task | None:
    """The task, or None while intake has not stored it yet (submitting only publishes)."""
    try:
        return await client.get(task_id)
    except NotFound:
        return None


def history(events: list[Any]) -> list[tuple[State | None, State, str]]:
    return [(e.from_status, e.to_status, e.reason) for e in events]


async def test_fifty_tasks_run_as_jobs_on_the_nodes_sked_placed_them_on(
    cluster: FakeCluster, deployment: Deployment, client: SkedClient
) -> None:
    await services(deployment, cluster)
    await start(deployment, cluster, "ky")  # a second replica serving the same cluster
    gpu = [task("ok", resources={"gpu": 1, "cpu": 1, "memory_mb": 512}) for _ in range(10)]
    cpu = [task("ok", resources={"cpu": 0.5, "memory_mb": 256}) for _ in range(40)]
    ids = await client.submit_many([*gpu, *cpu])
    done = await client.wait_all(ids, timeout=120)
    assert all(t.status is State.SUCCESS for t in done.values()), [
        (t.status, t.status_reason) for t in done.values() if t.status is not State.SUCCESS
    ]
    sent = {j["metadata"]["name"]: j for j in cluster.created_jobs}
    for number, task_id in enumerate(ids):
        t = done[task_id]
        name = job_name(t.id, t.attempt)
        assert cluster.create_counts[name] == 1  # two replicas, no double launch
        pod = sent[name]["spec"]["template"]["spec"]
        assert pod["nodeSelector"] == {"kubernetes.io/hostname": t.node}
        container = pod["containers"][0]
        if number < 10:
            assert t.node == "gpu-1"
            assert container["resources"] == {
                "requests": {"cpu": "1000m", "memory": "512Mi"},
                "limits": {"cpu": "1000m", "memory": "512Mi", "nvidia.com/gpu": "1"},
            }
        else:
            assert container["resources"]["requests"] == {"cpu": "500m", "memory": "256Mi"}
            assert "nvidia.com/gpu" not in container["resources"]["limits"]
        assert "done" in (t.log_tail or "")
    placed = {done[i].node for i in ids[10:]}
    assert placed <= {"cpu-a", "cpu-b", "gpu-1"}
    for job in sent.values():
        for version in ("1.30", "1.34"):
            kubernetes_validate.validate(job, version, strict=True)


async def test_an_executor_killed_mid_run_adopts_its_jobs_when_it_restarts(
    cluster: FakeCluster, deployment: Deployment, client: SkedClient
) -> None:
    executor = await services(deployment, cluster)
    ids = await client.submit_many([task("slow") for _ in range(6)])
    doomed = await client.submit(task("forever"))

    async def all_running() -> bool:
        tasks = [await get(client, i) for i in ids]
        return all(t is not None and t.status is State.RUNNING for t in tasks)

    await eventually(all_running, timeout=60, what="every attempt running")
    # mid-run: every Job's pod is running (not merely claimed in Postgres)
    names = [job_name(i, 1) for i in [*ids, doomed]]
    await cluster.wait_for(
        lambda: (
            all(p["status"].get("phase") == "Running" for n in names for p in cluster.pods_of(n))
            and all(cluster.pods_of(n) for n in names)
        ),
        timeout=30,
    )
    executor.kill()
    await client.cancel(doomed, "canceled while its executor was down")  # its Job runs on
    await start(deployment, cluster)  # the same node id: it finds the attempts it launched
    done = await client.wait_all(ids, timeout=60)
    assert all(t.status is State.SUCCESS for t in done.values())
    assert all(t.attempt == 1 for t in done.values())
    assert set(cluster.create_counts.values()) == {1}  # no Job was created twice
    assert "adopted" in deployment.procs[-1].log()
    # the Job of the task canceled meanwhile is superseded: the restarted executor deletes it
    await cluster.wait_for(lambda: not cluster.pods_of(job_name(doomed, 1)), timeout=30)


async def test_launch_failures_go_back_to_ready_without_a_retry_until_the_cap(
    cluster: FakeCluster, deployment: Deployment, client: SkedClient
) -> None:
    await services(deployment, cluster, budget_s=1.5)
    pull, stuck, missing = await client.submit_many(
        [
            task("pull", max_launch_failures=2, max_retries=1),
            task("stuck", max_launch_failures=1),
            task("missing", max_retries=3),
        ]
    )
    done = await client.wait_all([pull, stuck, missing], timeout=60)
    for t in done.values():
        assert t.status is State.FAILED, (t.name, t.status, t.status_reason)
    moves = history(await client.history(pull))
    back = [r for f, to, r in moves if (f, to) == (State.RUNNING, State.READY)]
    assert len(back) == 2
    assert "launch failure 1 of 2" in back[0]
    assert "ImagePullBackOff" in back[0]
    assert done[pull].retry_count == done[pull].max_retries  # final: no retry spent, none left
    assert "launch failures spent" in (done[pull].error or "")
    assert not any(to is State.RETRY_WAIT for _, to, _ in moves)
    assert "Unschedulable" in (done[stuck].error or "")
    # an image that does not exist fails at once, final, with the reason
    assert done[missing].launch_failures == 0
    assert done[missing].retry_count == 3
    assert "not found" in (done[missing].error or "")


async def test_a_not_ready_node_climbs_the_ladder_and_the_retry_waits_for_the_old_pods(
    cluster: FakeCluster, deployment: Deployment, client: SkedClient
) -> None:
    await services(deployment, cluster)
    events: list[tuple[int, str, str, str]] = []
    cluster.api.listeners.append(
        lambda e: events.append((e.rv, e.type, e.obj["kind"], e.obj["metadata"]["name"]))
    )
    task_id = await client.submit(task("forever", max_retries=1, selector={"pool": "cpu"}))

    async def running() -> Task | None:
        t = await get(client, task_id)
        return t if t is not None and t.status is State.RUNNING else None

    first = await eventually(running, what="attempt 1 running")
    await cluster.wait_for(lambda: cluster.pods_of(job_name(task_id, 1)), timeout=10)
    assert first.node is not None
    cluster.set_node_ready(first.node, False)

    async def second_attempt() -> Task | None:
        t = await client.get(task_id)
        return t if t.attempt == 2 and t.status is State.RUNNING else None

    second = await eventually(second_attempt, timeout=60, what="attempt 2 running")
    lost = [r for f, to, r in history(await client.history(task_id)) if to is State.LOST]
    assert len(lost) == 1
    for rung in (f"node {first.node} NotReady", "Job and pod: running", "log unchanged"):
        assert rung in lost[0]
    assert second.node != first.node
    old = job_name(task_id, 1)
    new = job_name(task_id, 2)
    await cluster.wait_for(lambda: new in cluster.jobs, timeout=30)
    old_pods_gone = max(
        v for v, t, k, n in events if (k, t) == ("Pod", "DELETED") and n.startswith(old)
    )
    new_job = min(v for v, t, k, n in events if (k, t) == ("Job", "ADDED") and n == new)
    assert old_pods_gone < new_job
    await client.cancel(task_id, "done with the test")
    await cluster.wait_for(lambda: not cluster.pods_of(new), timeout=10)


async def test_cancel_and_timeout_delete_the_job_and_its_pods(
    cluster: FakeCluster, deployment: Deployment, client: SkedClient
) -> None:
    await services(deployment, cluster)
    canceled, timed = await client.submit_many([task("forever"), task("forever", timeout_s=1)])
    await cluster.wait_for(lambda: cluster.pods_of(job_name(canceled, 1)), timeout=30)

    async def live_log() -> str | None:
        return await client.log(canceled)

    # `sked logs` of a running attempt reads its pod's log, through its executor
    assert "working" in await eventually(live_log, timeout=30, what="the pod's log")
    await client.cancel(canceled, "not needed")
    done = await client.wait_all([canceled, timed], timeout=60)
    assert done[canceled].status is State.CANCELED
    assert done[timed].status is State.TIMED_OUT
    for task_id in (canceled, timed):
        name = job_name(task_id, 1)
        await cluster.wait_for(lambda n=name: n not in cluster.jobs and not cluster.pods_of(n))


async def test_a_workflow_hands_a_jobs_declared_output_to_the_next_jobs_inputs(
    cluster: FakeCluster, deployment: Deployment, client: SkedClient
) -> None:
    """What a container wrote to $SKED_OUTPUT (its termination message) is its task's output;
    the next task finds it in the file named by $SKED_INPUTS (its Secret), as on the local
    backend."""
    await services(deployment, cluster)
    workflow_id = await client.submit_workflow(
        {
            "name": "k8s-data",
            "tasks": [
                {"name": "extract", "command": ["extract"], "image": "app:1"},
                {"name": "report", "command": ["report"], "image": "app:1", "needs": ["extract"]},
            ],
        }
    )
    view = await client.wait_workflow(workflow_id, timeout=60)
    tasks = {t.wf_task: t for t in view.tasks}
    assert all(t.status is State.SUCCESS for t in tasks.values()), [
        (t.wf_task, t.status, t.status_reason) for t in tasks.values()
    ]
    assert tasks["extract"].result == {"exit_code": 0, "output": {"rows": 41}}
    assert tasks["report"].inputs == {"extract": {"rows": 41}}
    assert tasks["report"].result == {"exit_code": 0, "output": {"extract": {"rows": 41}}}
    report = job_name(tasks["report"].id, 1)
    assert report in cluster.secrets  # owned by its Job: it goes with the Job's TTL
