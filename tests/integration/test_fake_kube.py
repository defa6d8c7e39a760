"""The fake cluster of tests/fakes/kube.py, proved with a real kubernetes_asyncio client over HTTP:
what the client sees is what the Kubernetes backend will see in its tests."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import aiohttp
import kubernetes_validate
import pytest
from kubernetes_asyncio import client, watch
from kubernetes_asyncio.client.exceptions import ApiException

from tests.fakes.kube import (
    JOBS,
    DeadlineExceeded,
    Event,
    Evicted,
    Fail,
    FakeCluster,
    ImageNotFound,
    ImagePullBackOff,
    RunUntilDeleted,
    Scenario,
    Succeed,
    Unschedulable,
    fake_cluster,
)

NS = "sked"
T = TypeVar("T")


def job_body(
    name: str,
    *,
    node: str | None = None,
    labels: dict[str, str] | None = None,
    gpu: int = 0,
    deadline: int | None = None,
) -> dict[str, Any]:
    """A Job as the backend writes one: no retries, FailJob rules, a node hint."""
    container: dict[str, Any] = {"name": "main", "image": "busybox:1.36", "command": ["true"]}
    if gpu:
        container["resources"] = {"limits": {"nvidia.com/gpu": str(gpu)}}
    pod_spec: dict[str, Any] = {"restartPolicy": "Never", "containers": [container]}
    if node:
        pod_spec["nodeSelector"] = {"kubernetes.io/hostname": node}
    rules = [
        {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        {"action": "FailJob", "onExitCodes": {"operator": "NotIn", "values": [0]}},
    ]
    spec: dict[str, Any] = {
        "backoffLimit": 0,
        "podFailurePolicy": {"rules": rules},
        "template": {"metadata": {"labels": dict(labels or {})}, "spec": pod_spec},
    }
    if deadline:
        spec["activeDeadlineSeconds"] = deadline
    metadata = {"name": name, "labels": dict(labels or {})}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": metadata, "spec": spec}


async def eventually(check: Callable[[], Awaitable[T | None]], timeout: float = 3.0) -> T:
    """Poll an async check until it returns something truthy."""
    async with asyncio.timeout(timeout):
        while True:
            if result := await check():
                return result
            await asyncio.sleep(0.02)


def condition(obj: Any, kind: str) -> Any:
    return next((c for c in obj.status.conditions or [] if c.type == kind), None)


@pytest.fixture
async def cluster() -> AsyncIterator[FakeCluster]:
    async with fake_cluster() as fake:
        fake.add_node("node-a")
        fake.add_node("node-b", gpu=2, labels={"pool": "gpu"})
        yield fake


@pytest.fixture
async def api(cluster: FakeCluster) -> AsyncIterator[client.ApiClient]:
    async with client.ApiClient(cluster.configuration()) as api_client:
        yield api_client


async def test_a_job_runs_on_its_hinted_node_and_completes(
    cluster: FakeCluster, api: client.ApiClient
) -> None:
    batch, core = client.BatchV1Api(api), client.CoreV1Api(api)
    created = await batch.create_namespaced_job(
        NS, job_body("hello", node="node-b", labels={"t": "1"})
    )
    meta = created.metadata
    assert meta.uid
    assert meta.namespace == NS
    assert int(meta.resource_version) > 0
    assert meta.creation_timestamp is not None
    assert created.spec.template.metadata.labels["batch.kubernetes.io/job-name"] == "hello"

    async def complete() -> Any:
        job = await batch.read_namespaced_job("hello", NS)
        return job if condition(job, "Complete") else None

    job = await eventually(complete)
    assert job.status.succeeded == 1
    assert not job.status.active
    assert job.status.completion_time is not None
    assert condition(job, "Complete").status == "True"
    assert int(job.metadata.resource_version) > int(meta.resource_version)

    pods = (await core.list_namespaced_pod(NS, label_selector="job-name=hello")).items
    assert len(pods) == 1
    pod = pods[0]
    assert pod.metadata.name.startswith("hello-")
    assert len(pod.metadata.name) == len("hello-") + 5
    assert pod.spec.node_name == "node-b"
    assert pod.metadata.labels["t"] == "1"
    assert pod.metadata.labels["batch.kubernetes.io/controller-uid"] == meta.uid
    assert pod.metadata.labels["controller-uid"] == meta.uid
    owner = pod.metadata.owner_references[0]
    assert (owner.kind, owner.name, owner.uid, owner.controller) == ("Job", "hello", meta.uid, True)
    assert pod.status.phase == "Succeeded"
    terminated = pod.status.container_statuses[0].state.terminated
    assert (terminated.exit_code, terminated.reason) == (0, "Completed")
    assert terminated.started_at is not None
    assert terminated.finished_at is not None
    assert pod.status.start_time is not None
    assert cluster.create_counts == {"hello": 1}
    assert cluster.created_jobs[0]["metadata"]["name"] == "hello"


async def test_the_job_condition_comes_only_after_its_pod_terminated(cluster: FakeCluster) -> None:
    events: list[Event] = []
    cluster.api.listeners.append(events.append)
    cluster.script = lambda job: {"ok": Succeed(), "bad": Fail(2)}[job["metadata"]["name"]]
    async with client.ApiClient(cluster.configuration()) as api:
        for name in ("ok", "bad"):
            await client.BatchV1Api(api).create_namespaced_job(NS, job_body(name))
    await cluster.wait_for(
        lambda: all(j["status"].get("conditions") for j in cluster.jobs.values())
    )
    for name, final in (("ok", "Complete"), ("bad", "Failed")):
        pod_done = next(
            e.rv
            for e in events
            if e.obj["metadata"].get("labels", {}).get("job-name") == name
            and e.obj["kind"] == "Pod"
            and e.obj["status"]["phase"] in ("Succeeded", "Failed")
        )
        job_done = next(
            e.rv
            for e in events
            if e.resource == JOBS
            and e.obj["metadata"]["name"] == name
            and any(c["type"] == final for c in e.obj["status"].get("conditions", []))
        )
        assert pod_done < job_done


async def test_a_watch_sees_added_and_modified_for_its_selector_only(
    cluster: FakeCluster, api: client.ApiClient
) -> None:
    batch = client.BatchV1Api(api)
    await batch.create_namespaced_job(NS, job_body("before", labels={"app": "sked"}))
    listed = await batch.list_namespaced_job(NS, label_selector="app=sked")
    since = listed.metadata.resource_version
    seen: list[tuple[str, str]] = []
    async with watch.Watch() as w, asyncio.timeout(5):
        stream = w.stream(
            batch.list_namespaced_job, NS, label_selector="app=sked", resource_version=since
        )
        await batch.create_namespaced_job(NS, job_body("other", labels={"app": "else"}))
        await batch.create_namespaced_job(NS, job_body("mine", labels={"app": "sked"}))
        async for event in stream:
            seen.append((event["type"], event["object"].metadata.name))
            if event["object"].metadata.name == "mine" and condition(event["object"], "Complete"):
                break
    assert "other" not in {name for _, name in seen}
    mine = [kind for kind, name in seen if name == "mine"]
    assert mine[0] == "ADDED"
    assert set(mine[1:]) == {"MODIFIED"}
    assert ("ADDED", "before") not in seen  # listed before the watch; its MODIFIEDs may come


async def test_a_watch_without_resource_version_starts_with_the_current_state(
    cluster: FakeCluster, api: client.ApiClient
) -> None:
    core = client.CoreV1Api(api)
    async with watch.Watch() as w, asyncio.timeout(5):
        stream = w.stream(core.list_node, timeout_seconds=1)
        seen = [(e["type"], e["object"].metadata.name) async for e in stream]
    assert seen == [("ADDED", "node-a"), ("ADDED", "node-b")]


async def test_a_watch_turns_objects_leaving_the_selector_into_deleted(
    cluster: FakeCluster, api: client.ApiClient
) -> None:
    core = client.CoreV1Api(api)
    async with watch.Watch() as w, asyncio.timeout(5):
        stream = w.stream(core.list_node, label_selector="pool=gpu", timeout_seconds=1)
        first = await stream.__anext__()
        assert (first["type"], first["object"].metadata.name) == ("ADDED", "node-b")
        await core.patch_node("node-b", {"metadata": {"labels": {"pool": None}}})
        gone = await stream.__anext__()
    assert (gone["type"], gone["object"].metadata.name) == ("DELETED", "node-b")


async def test_label_and_field_selectors_filter_lists(
    cluster: FakeCluster, api: client.ApiClient
) -> None:
    cluster.script = lambda job: RunUntilDeleted()
    batch = client.BatchV1Api(api)
    for name, labels in (
        ("j1", {"a": "b", "c": "d"}),
        ("j2", {"a": "b"}),
        ("j3", {"a": "x", "c": "e"}),
    ):
        await batch.create_namespaced_job(NS, job_body(name, labels=labels))

    async def names(**selectors: str) -> list[str]:
        jobs = await batch.list_namespaced_job(NS, **selectors)
        return [j.metadata.name for j in jobs.items]

    assert await names(label_selector="a=b") == ["j1", "j2"]
    assert await names(label_selector="a=b,c=d") == ["j1"]
    assert await names(label_selector="c") == ["j1", "j3"]
    assert await names(label_selector="!c") == ["j2"]
    assert await names(label_selector="a!=b") == ["j3"]
    assert await names(label_selector="c in (d,e),a notin (b)") == ["j3"]
    assert await names(field_selector="metadata.name=j2") == ["j2"]
    assert await names(label_selector="a=b", field_selector="metadata.name!=j1") == ["j2"]
    all_jobs = await client.BatchV1Api(api).list_job_for_all_namespaces(label_selector="a")
    assert len(all_jobs.items) == 3


async def test_a_lost_create_response_then_the_retry_meets_409(
    cluster: FakeCluster, api: client.ApiClient
) -> None:
    batch = client.BatchV1Api(api)
    cluster.fail_next_create()
    with pytest.raises(ApiException) as lost:
        await batch.create_namespaced_job(NS, job_body("once"))
    assert lost.value.status == 500
    with pytest.raises(ApiException) as again:
        await batch.create_namespaced_job(NS, job_body("once"))
    assert again.value.status == 409
    assert '"reason":"AlreadyExists"' in again.value.body.replace(" ", "")
    assert cluster.create_counts == {"once": 1}
    assert cluster.create_attempts == {"once": 2}
    await cluster.wait_for(lambda: len(cluster.pods_of("once")) == 1)


async def test_a_create_refused_before_storing_leaves_nothing(
    cluster: FakeCluster, api: client.ApiClient
) -> None:
    cluster.fail_next_create(status=503, stored=False)
    with pytest.raises(ApiException) as refused:
        await client.BatchV1Api(api).create_namespaced_job(NS, job_body("never"))
    assert refused.value.status == 503
    assert cluster.jobs == {}
    assert cluster.create_attempts == {"never": 1}


async def test_kmock_dsl_interceptions_still_apply_after_the_store(
    cluster: FakeCluster, api: client.ApiClient
) -> None:
    _ = cluster.api["create", JOBS][:1] << 500
    batch = client.BatchV1Api(api)
    with pytest.raises(ApiException) as lost:
        await batch.create_namespaced_job(NS, job_body("dsl"))
    assert lost.value.status == 500
    assert "dsl" in cluster.jobs
    with pytest.raises(ApiException) as again:
        await batch.create_namespaced_job(NS, job_body("dsl"))
    assert again.value.status == 409


async def test_an_injected_410_surfaces_as_an_api_exception(
    cluster: FakeCluster, api: client.ApiClient
) -> None:
    batch = client.BatchV1Api(api)
    cluster.expire_next_watch()
    async with watch.Watch() as w, asyncio.timeout(5):
        # With timeout_seconds, kubernetes-asyncio does not retry a 410 (without it, once).
        stream = w.stream(batch.list_namespaced_job, NS, resource_version="1", timeout_seconds=5)
        with pytest.raises(ApiException) as gone:
            await stream.__anext__()
    assert gone.value.status == 410
    async with watch.Watch() as w, asyncio.timeout(5):  # one expiry injected, one used
        stream = w.stream(batch.list_namespaced_job, NS, resource_version="1", timeout_seconds=1)
        assert [event async for event in stream] == []


async def test_a_watch_from_before_compaction_gets_410_even_after_the_client_retries(
    cluster: FakeCluster, api: client.ApiClient
) -> None:
    batch = client.BatchV1Api(api)
    since = (await batch.list_namespaced_job(NS)).metadata.resource_version
    await batch.create_namespaced_job(NS, job_body("moves"))
    cluster.compact()
    async with watch.Watch() as w, asyncio.timeout(5):
        stream = w.stream(batch.list_namespaced_job, NS, resource_version=since)
        with pytest.raises(ApiException) as gone:
            await stream.__anext__()
    assert gone.value.status == 410
    relisted = (await batch.list_namespaced_job(NS)).metadata.resource_version
    async with watch.Watch() as w, asyncio.timeout(5):
        stream = w.stream(batch.list_namespaced_job, NS, resource_version=relisted)
        await batch.patch_namespaced_job("moves", NS, {"metadata": {"labels": {"x": "y"}}})
        event = await stream.__anext__()
    assert event["type"] == "MODIFIED"


async def test_cut_watches_break_the_client_stream(
    cluster: FakeCluster, api: client.ApiClient
) -> None:
    core = client.CoreV1Api(api)
    async with watch.Watch() as w, asyncio.timeout(5):
        stream = w.stream(core.list_node)
        await stream.__anext__()
        await stream.__anext__()
        assert cluster.cut_watches() == 1
        with pytest.raises(aiohttp.ClientPayloadError):
            await stream.__anext__()


async def test_cleanly_cut_watches_end_the_client_stream(
    cluster: FakeCluster, api: client.ApiClient
) -> None:
    core = client.CoreV1Api(api)
    async with watch.Watch() as w, asyncio.timeout(5):
        stream = w.stream(core.list_node, timeout_seconds=30)
        await stream.__anext__()
        await stream.__anext__()
        assert cluster.cut_watches(abrupt=False) == 1
        rest = [event async for event in stream]
    assert rest == []


async def test_the_pod_log_is_served_as_text(cluster: FakeCluster, api: client.ApiClient) -> None:
    text = '{"looks": "like json"}\nsecond line\n'
    cluster.script = lambda job: Succeed(log=text)
    await client.BatchV1Api(api).create_namespaced_job(NS, job_body("logs"))
    pod = await cluster.wait_for(lambda: cluster.pods_of("logs"))
    name = pod[0]["metadata"]["name"]
    await cluster.wait_for(lambda: cluster.pods[name]["status"]["phase"] == "Succeeded")
    core = client.CoreV1Api(api)
    response = await core.read_namespaced_pod_log(name, NS, _preload_content=False)
    assert response.headers["Content-Type"].startswith("text/plain")
    assert (await response.read()).decode() == text
    tail = await core.read_namespaced_pod_log(name, NS, tail_lines=1, _preload_content=False)
    assert await tail.read() == b"second line\n"
    with pytest.raises(ApiException) as missing:
        await core.read_namespaced_pod_log("nope", NS)
    assert missing.value.status == 404


@pytest.mark.parametrize(("policy", "pods_left"), [("Background", 0), ("Foreground", 0), (None, 1)])
async def test_deleting_a_job_collects_its_pods_unless_orphaned(
    cluster: FakeCluster, api: client.ApiClient, policy: str | None, pods_left: int
) -> None:
    cluster.script = lambda job: RunUntilDeleted()
    batch = client.BatchV1Api(api)
    await batch.create_namespaced_job(NS, job_body("doomed"))
    await cluster.wait_for(lambda: cluster.jobs["doomed"]["status"].get("ready") == 1)
    deleted = await batch.delete_namespaced_job("doomed", NS, propagation_policy=policy)
    if policy == "Foreground":  # the Job (not a Status) comes back, and waits for its pods
        assert deleted.kind == "Job"
        meta = cluster.jobs["doomed"]["metadata"]
        assert meta["deletionTimestamp"]
        assert meta["finalizers"] == ["foregroundDeletion"]
    else:
        assert deleted.status == "Success"
        assert "doomed" not in cluster.jobs
    await cluster.wait_for(lambda: "doomed" not in cluster.jobs)
    if pods_left:  # orphaned: still running, no owner any more
        pods = await cluster.wait_for(
            lambda: [p for p in cluster.pods_of("doomed") if "ownerReferences" not in p["metadata"]]
        )
        assert pods[0]["status"]["phase"] == "Running"
    else:
        await cluster.wait_for(lambda: not cluster.pods_of("doomed"))
    assert len(cluster.pods_of("doomed")) == pods_left


async def test_a_finished_job_with_a_ttl_goes_away_with_its_pods(
    cluster: FakeCluster, api: client.ApiClient
) -> None:
    body = job_body("short-lived")
    body["spec"]["ttlSecondsAfterFinished"] = 0
    await client.BatchV1Api(api).create_namespaced_job(NS, body)
    await cluster.wait_for(lambda: cluster.pods_of("short-lived"))
    await cluster.wait_for(lambda: "short-lived" not in cluster.jobs)
    await cluster.wait_for(lambda: not cluster.pods_of("short-lived"))


async def test_a_pod_deleted_under_its_running_job_fails_the_job(
    cluster: FakeCluster, api: client.ApiClient
) -> None:
    cluster.script = lambda job: RunUntilDeleted()
    await client.BatchV1Api(api).create_namespaced_job(NS, job_body("victim"))
    pod = (await cluster.wait_for(lambda: cluster.pods_of("victim")))[0]
    await cluster.wait_for(lambda: cluster.jobs["victim"]["status"].get("ready") == 1)
    await client.CoreV1Api(api).delete_namespaced_pod(pod["metadata"]["name"], NS)
    job = await cluster.wait_for(lambda: _with_condition(cluster.jobs["victim"], "Failed"))
    failed = _condition(job, "Failed")
    assert failed["reason"] == "PodFailurePolicy"
    assert "exit code 143" in failed["message"]


def _find(obj: dict[str, Any], kind: str) -> dict[str, Any] | None:
    return next((c for c in obj["status"].get("conditions") or [] if c["type"] == kind), None)


def _condition(obj: dict[str, Any], kind: str) -> dict[str, Any]:
    found = _find(obj, kind)
    assert found is not None, f"no {kind} condition in {obj['status']}"
    return found


def _with_condition(obj: dict[str, Any], kind: str) -> dict[str, Any] | None:
    return obj if _find(obj, kind) else None


def _waiting(pod: dict[str, Any]) -> dict[str, Any]:
    statuses = pod["status"].get("containerStatuses") or [{"state": {}}]
    return dict(statuses[0]["state"].get("waiting") or {})


async def _scenario(cluster: FakeCluster, scenario: Scenario, **job: Any) -> str:
    cluster.script = lambda _: scenario
    async with client.ApiClient(cluster.configuration()) as api:
        await client.BatchV1Api(api).create_namespaced_job(NS, job_body("run", **job))
    pods = await cluster.wait_for(lambda: cluster.pods_of("run"))
    return str(pods[0]["metadata"]["name"])


async def test_fail_ends_with_the_exit_code_and_the_matching_rule(cluster: FakeCluster) -> None:
    pod = await _scenario(cluster, Fail(exit_code=3, log="boom"))
    job = await cluster.wait_for(lambda: _with_condition(cluster.jobs["run"], "Failed"))
    assert job["status"]["failed"] == 1
    assert "active" not in job["status"]
    failed = _condition(job, "Failed")
    assert failed["reason"] == "PodFailurePolicy"
    assert failed["message"] == (
        f"Container main for pod {NS}/{pod} failed with exit code 3 "
        "matching FailJob rule at index 1"
    )
    assert _condition(job, "FailureTarget")["reason"] == "PodFailurePolicy"
    terminated = cluster.pods[pod]["status"]["containerStatuses"][0]["state"]["terminated"]
    assert (terminated["exitCode"], terminated["reason"]) == (3, "Error")
    assert cluster.pods[pod]["status"]["phase"] == "Failed"


async def test_run_until_deleted_keeps_running_and_ready(cluster: FakeCluster) -> None:
    pod = await _scenario(cluster, RunUntilDeleted(log="working"))
    await cluster.wait_for(lambda: cluster.jobs["run"]["status"].get("ready") == 1)
    await asyncio.sleep(0.2)
    status = cluster.pods[pod]["status"]
    assert status["phase"] == "Running"
    assert status["containerStatuses"][0]["ready"] is True
    assert "startedAt" in status["containerStatuses"][0]["state"]["running"]
    assert {c["type"]: c["status"] for c in status["conditions"]}["Ready"] == "True"
    job = cluster.jobs["run"]
    assert job["status"]["active"] == 1
    assert "conditions" not in job["status"]


@pytest.mark.parametrize(
    ("scenario", "pull_words"),
    [(ImagePullBackOff(), "i/o timeout"), (ImageNotFound(), "not found")],
)
async def test_image_pull_failures_wait_in_pending(
    cluster: FakeCluster, api: client.ApiClient, scenario: Scenario, pull_words: str
) -> None:
    pod = await _scenario(cluster, scenario)
    first = await cluster.wait_for(
        lambda: _waiting(cluster.pods[pod]).get("reason") == "ErrImagePull"
    )
    assert first
    assert pull_words in _waiting(cluster.pods[pod])["message"]
    await cluster.wait_for(lambda: _waiting(cluster.pods[pod]).get("reason") == "ImagePullBackOff")
    waiting = _waiting(cluster.pods[pod])
    assert waiting["message"].startswith('Back-off pulling image "busybox:1.36"')
    assert pull_words in waiting["message"]
    assert cluster.pods[pod]["status"]["phase"] == "Pending"
    assert "conditions" not in cluster.jobs["run"]["status"]
    with pytest.raises(ApiException) as not_started:
        await client.CoreV1Api(api).read_namespaced_pod_log(pod, NS)
    assert not_started.value.status == 400


async def test_unschedulable_stays_pending_with_the_scheduler_message(cluster: FakeCluster) -> None:
    pod = await _scenario(cluster, Unschedulable())
    await cluster.wait_for(lambda: cluster.pods[pod]["status"].get("conditions"))
    status = cluster.pods[pod]["status"]
    scheduled = status["conditions"][0]
    assert (scheduled["type"], scheduled["status"], scheduled["reason"]) == (
        "PodScheduled",
        "False",
        "Unschedulable",
    )
    assert scheduled["message"].startswith("0/3 nodes are available:")
    assert "Insufficient nvidia.com/gpu" in scheduled["message"]
    assert status["phase"] == "Pending"
    assert "nodeName" not in cluster.pods[pod]["spec"]


async def test_deadline_exceeded_kills_the_pod_then_fails_the_job(cluster: FakeCluster) -> None:
    pod = await _scenario(cluster, DeadlineExceeded(after_s=0.1))
    job = await cluster.wait_for(lambda: _with_condition(cluster.jobs["run"], "Failed"))
    assert _condition(job, "Failed")["reason"] == "DeadlineExceeded"
    assert _condition(job, "FailureTarget")["reason"] == "DeadlineExceeded"
    assert pod not in cluster.pods
    assert job["status"]["failed"] == 1


async def test_active_deadline_seconds_is_enforced(cluster: FakeCluster) -> None:
    await _scenario(cluster, ImagePullBackOff(), deadline=1)
    job = await cluster.wait_for(lambda: _with_condition(cluster.jobs["run"], "Failed"), timeout=3)
    assert _condition(job, "Failed")["reason"] == "DeadlineExceeded"
    assert cluster.pods_of("run") == []


async def test_eviction_by_the_api_fails_the_job_by_its_disruption_rule(
    cluster: FakeCluster,
) -> None:
    events: list[Event] = []
    cluster.api.listeners.append(events.append)
    pod = await _scenario(cluster, Evicted(after_s=0.05))
    job = await cluster.wait_for(lambda: _with_condition(cluster.jobs["run"], "Failed"))
    failed = _condition(job, "Failed")
    assert failed["reason"] == "PodFailurePolicy"
    assert (
        failed["message"]
        == f"Pod {NS}/{pod} has condition DisruptionTarget matching FailJob rule at index 0"
    )
    await cluster.wait_for(lambda: pod not in cluster.pods)
    last = [e.obj for e in events if e.obj["metadata"]["name"] == pod][-1]
    disruption = _condition(last, "DisruptionTarget")
    assert (disruption["status"], disruption["reason"]) == ("True", "EvictionByEvictionAPI")
    assert last["status"]["phase"] == "Failed"


async def test_eviction_by_the_kubelet_leaves_a_failed_pod(cluster: FakeCluster) -> None:
    pod = await _scenario(cluster, Evicted(after_s=0.05, reason="TerminationByKubelet"))
    await cluster.wait_for(lambda: _with_condition(cluster.jobs["run"], "Failed"))
    status = cluster.pods[pod]["status"]
    assert (status["phase"], status["reason"]) == ("Failed", "Evicted")
    assert _condition(cluster.pods[pod], "DisruptionTarget")["reason"] == "TerminationByKubelet"


async def test_nodes_look_real_and_follow_readiness_and_cordoning(
    cluster: FakeCluster, api: client.ApiClient
) -> None:
    core = client.CoreV1Api(api)
    node = await core.read_node("node-b")
    assert node.metadata.labels["kubernetes.io/hostname"] == "node-b"
    assert node.metadata.labels["pool"] == "gpu"
    assert node.status.allocatable["nvidia.com/gpu"] == "2"
    assert node.status.allocatable["cpu"] == "4"
    assert condition(node, "Ready").status == "True"
    assert not node.spec.unschedulable
    assert "nvidia.com/gpu" not in (await core.read_node("node-a")).status.allocatable

    cluster.set_node_ready("node-b", False)
    cluster.cordon("node-b")
    node = await core.read_node("node-b")
    assert condition(node, "Ready").status == "False"
    assert node.spec.unschedulable is True
    assert {t.key for t in node.spec.taints} == {
        "node.kubernetes.io/not-ready",
        "node.kubernetes.io/unschedulable",
    }


async def test_a_pod_waits_for_its_node_to_become_schedulable(cluster: FakeCluster) -> None:
    cluster.cordon("node-b")
    pod = await _scenario(cluster, Succeed(), node="node-b")
    await cluster.wait_for(lambda: _find(cluster.pods[pod], "PodScheduled"))
    message = _condition(cluster.pods[pod], "PodScheduled")["message"]
    assert "1 node(s) were unschedulable" in message
    assert "1 node(s) didn't match Pod's node affinity/selector" in message
    cluster.uncordon("node-b")
    await cluster.wait_for(lambda: _with_condition(cluster.jobs["run"], "Complete"))
    assert cluster.pods[pod]["spec"]["nodeName"] == "node-b"


async def test_gpu_pods_go_where_the_gpus_are(cluster: FakeCluster) -> None:
    pod = await _scenario(cluster, Succeed(), gpu=1)
    await cluster.wait_for(lambda: cluster.pods[pod]["spec"].get("nodeName"))
    assert cluster.pods[pod]["spec"]["nodeName"] == "node-b"


async def test_invalid_jobs_are_refused_with_422(
    cluster: FakeCluster, api: client.ApiClient
) -> None:
    batch = client.BatchV1Api(api)
    with pytest.raises(ApiException) as too_long:
        await batch.create_namespaced_job(NS, job_body("x" * 64))
    assert too_long.value.status == 422
    body = job_body("always")
    body["spec"]["template"]["spec"]["restartPolicy"] = "Always"
    with pytest.raises(ApiException) as always:
        await batch.create_namespaced_job(NS, body)
    assert always.value.status == 422
    assert "restartPolicy" in always.value.body
    assert cluster.jobs == {}


async def test_status_changes_only_through_the_status_subresource(
    cluster: FakeCluster, api: client.ApiClient
) -> None:
    cluster.script = lambda job: RunUntilDeleted()
    batch = client.BatchV1Api(api)
    await batch.create_namespaced_job(NS, job_body("st"))
    await cluster.wait_for(lambda: cluster.jobs["st"]["status"].get("ready") == 1)
    await batch.patch_namespaced_job("st", NS, {"status": {"active": 7}})
    assert cluster.jobs["st"]["status"]["active"] == 1
    patched = await batch.patch_namespaced_job_status("st", NS, {"status": {"active": 7}})
    assert patched.status.active == 7
    with pytest.raises(ApiException) as stale:
        await batch.patch_namespaced_job("st", NS, {"metadata": {"resourceVersion": "1"}})
    assert stale.value.status == 409
    with pytest.raises(ApiException) as missing:
        await batch.patch_namespaced_job_status("nope", NS, {"status": {}})
    assert missing.value.status == 404


async def test_closing_the_cluster_leaves_no_tasks() -> None:
    async with fake_cluster(lambda job: RunUntilDeleted()) as cluster:
        cluster.add_node("n")
        async with client.ApiClient(cluster.configuration()) as api:
            await client.BatchV1Api(api).create_namespaced_job(NS, job_body("left"))
            await cluster.wait_for(lambda: cluster.jobs["left"]["status"].get("ready"))
            w = watch.Watch()
            stream = w.stream(client.CoreV1Api(api).list_node)
            await stream.__anext__()
        await w.close()
    await asyncio.sleep(0)
    others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    assert others == []


@pytest.mark.parametrize(
    "scenario",
    [
        Succeed(),
        Fail(),
        DeadlineExceeded(),
        Evicted(),
        Evicted(reason="TerminationByKubelet"),
        ImageNotFound(),
        Unschedulable(),
    ],
    ids=lambda s: f"{type(s).__name__}-{getattr(s, 'reason', '')}",
)
async def test_every_version_the_fake_writes_is_schema_valid(
    cluster: FakeCluster, scenario: Scenario
) -> None:
    events: list[Event] = []
    cluster.api.listeners.append(events.append)
    cluster.set_node_ready("node-a", False)
    cluster.cordon("node-a")
    await _scenario(cluster, scenario)
    await asyncio.sleep(0.4)
    assert len(events) > 4
    for event in events:
        kubernetes_validate.validate(event.obj, "1.31", strict=True)


# ---- Secrets, secret volumes and termination messages
def b64(text: str | bytes) -> str:
    data = text.encode() if isinstance(text, str) else text
    return base64.b64encode(data).decode("ascii")


def secret_body(name: str, data: dict[str, bytes] | None = None, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name}}
    if data is not None:
        body["data"] = {key: b64(value) for key, value in data.items()}
    return {**body, **extra}


def inputs_job(
    name: str, secret: str | None = None, *, optional: bool = False, **source: Any
) -> dict[str, Any]:
    """A Job as the backend writes one with inputs: a secret volume at /var/run/sked and the
    container's output in its termination message file, falling back to the log on failure."""
    body = job_body(name)
    container = body["spec"]["template"]["spec"]["containers"][0]
    container["terminationMessagePath"] = "/dev/sked-output"
    container["terminationMessagePolicy"] = "FallbackToLogsOnError"
    container["volumeMounts"] = [
        {"name": "sked-inputs", "mountPath": "/var/run/sked", "readOnly": True}
    ]
    volume = {"secretName": secret or name, "defaultMode": 0o444, **source}
    if optional:
        volume["optional"] = True
    body["spec"]["template"]["spec"]["volumes"] = [{"name": "sked-inputs", "secret": volume}]
    return body


def terminated(cluster: FakeCluster, pod: str) -> dict[str, Any]:
    return dict(cluster.pods[pod]["status"]["containerStatuses"][0]["state"]["terminated"])


async def test_secrets_are_stored_listed_watched_and_deleted(
    cluster: FakeCluster, api: client.ApiClient
) -> None:
    core = client.CoreV1Api(api)
    since = (await core.list_namespaced_secret(NS)).metadata.resource_version
    async with watch.Watch() as w, asyncio.timeout(5):
        stream = w.stream(core.list_namespaced_secret, NS, resource_version=since)
        body = secret_body(
            "s1",
            {"a": b"alpha", "b": b"old"},
            stringData={"b": "bravo", "c": "charlie é"},
            immutable=True,
        )
        body["metadata"]["labels"] = {"app": "sked"}
        created = await core.create_namespaced_secret(NS, body)
        await core.create_namespaced_secret(NS, secret_body("s2", {"x": b"y"}))
        added = await stream.__anext__()
        assert (added["type"], added["object"].metadata.name) == ("ADDED", "s1")
        await stream.__anext__()  # s2
        deleted = await core.delete_namespaced_secret("s1", NS)
        gone = await stream.__anext__()
    assert (gone["type"], gone["object"].metadata.name) == ("DELETED", "s1")
    assert deleted.status == "Success"
    assert created.metadata.uid
    assert int(created.metadata.resource_version) > int(since)
    assert created.type == "Opaque"
    assert created.immutable is True
    assert created.string_data is None
    assert created.data == {"a": b64("alpha"), "b": b64("bravo"), "c": b64("charlie é")}
    assert list(cluster.secrets) == ["s2"]
    assert "stringData" not in cluster.secrets["s2"]
    await core.create_namespaced_secret(NS, secret_body("s3", {"k": b"v"}))
    listed = await core.list_namespaced_secret(NS, field_selector="metadata.name=s3")
    assert [s.metadata.name for s in listed.items] == ["s3"]
    assert listed.kind == "SecretList"
    read = await core.read_namespaced_secret("s3", NS)
    assert base64.b64decode(read.data["k"]) == b"v"
    with pytest.raises(ApiException) as duplicate:
        await core.create_namespaced_secret(NS, secret_body("s3", {"k": b"v"}))
    assert duplicate.value.status == 409
    with pytest.raises(ApiException) as missing:
        await core.read_namespaced_secret("s1", NS)
    assert missing.value.status == 404
    kubernetes_validate.validate(cluster.secrets["s3"], "1.31", strict=True)


# kubernetes_asyncio hands aiohttp the JSON of a 1 MiB Secret (1.4 MB of base64) as one string
@pytest.mark.filterwarnings("ignore:Sending a large body directly:ResourceWarning")
async def test_invalid_secrets_are_refused(cluster: FakeCluster, api: client.ApiClient) -> None:
    core = client.CoreV1Api(api)
    with pytest.raises(ApiException) as bad_name:
        await core.create_namespaced_secret(NS, secret_body("Not_A_Name", {"k": b"v"}))
    assert bad_name.value.status == 422
    body = secret_body("b")
    body["data"] = {"k": "not base64!"}
    with pytest.raises(ApiException) as bad_base64:
        await core.create_namespaced_secret(NS, body)
    assert bad_base64.value.status == 400
    assert json.loads(bad_base64.value.body)["message"] == (
        'Secret in version "v1" cannot be handled as a Secret: illegal base64 data at input byte 3'
    )
    with pytest.raises(ApiException) as bad_key:
        await core.create_namespaced_secret(NS, secret_body("k", {"a/b": b"v"}))
    assert bad_key.value.status == 422
    assert "a valid config key" in bad_key.value.body

    # the decoded data counts, across keys (stringData included): 1 MiB is the most
    half = 512 * 1024
    exact = secret_body("exact", {"a": b"x" * half}, stringData={"b": "y" * half})
    await core.create_namespaced_secret(NS, exact)
    over = secret_body("over", {"a": b"x" * half}, stringData={"b": "y" * (half + 1)})
    with pytest.raises(ApiException) as too_big:
        await core.create_namespaced_secret(NS, over)
    assert too_big.value.status == 422
    status = json.loads(too_big.value.body)
    assert status["reason"] == "Invalid"
    assert status["message"] == (
        'Secret "over" is invalid: data: Too long: must have at most 1048576 bytes'
    )
    two = secret_body("Two", {"a/b": b"x" * (2 * half + 1)})
    with pytest.raises(ApiException) as both:
        await core.create_namespaced_secret(NS, two)
    message = json.loads(both.value.body)["message"]
    assert message.startswith('Secret "Two" is invalid: [metadata.name: Invalid value: "Two"')
    assert message.endswith("data: Too long: must have at most 1048576 bytes]")
    assert list(cluster.secrets) == ["exact"]


async def test_an_immutable_secret_keeps_its_data(
    cluster: FakeCluster, api: client.ApiClient
) -> None:
    core = client.CoreV1Api(api)
    await core.create_namespaced_secret(NS, secret_body("frozen", {"k": b"v"}, immutable=True))
    forbidden = "Forbidden: field is immutable when `immutable` is set"
    for patch, wrong in (
        ({"data": {"k": b64("w")}}, "data"),
        ({"stringData": {"k": "w"}}, "data"),
        ({"data": {"other": b64("w")}}, "data"),
        ({"immutable": False}, "immutable"),
    ):
        with pytest.raises(ApiException) as refused:
            await core.patch_namespaced_secret("frozen", NS, patch)
        assert refused.value.status == 422
        assert json.loads(refused.value.body)["message"] == (
            f'Secret "frozen" is invalid: {wrong}: {forbidden}'
        )
    whole = await core.read_namespaced_secret("frozen", NS)
    whole.data = {"k": b64("w")}
    with pytest.raises(ApiException) as replaced:
        await core.replace_namespaced_secret("frozen", NS, whole)
    assert replaced.value.status == 422
    # the same data, the labels, and a mutable Secret's data may change
    same = await core.patch_namespaced_secret(
        "frozen", NS, {"stringData": {"k": "v"}, "metadata": {"labels": {"a": "b"}}}
    )
    assert same.metadata.labels == {"a": "b"}
    with pytest.raises(ApiException) as retyped:
        await core.patch_namespaced_secret("frozen", NS, {"type": "kubernetes.io/tls"})
    assert "type: Invalid value" in retyped.value.body
    await core.create_namespaced_secret(NS, secret_body("thawed", {"k": b"v"}))
    patched = await core.patch_namespaced_secret("thawed", NS, {"stringData": {"k": "w"}})
    assert patched.data == {"k": b64("w")}
    assert cluster.secrets["frozen"]["data"] == {"k": b64("v")}


@pytest.mark.parametrize(("policy", "left"), [("Background", False), (None, True)])
async def test_a_secret_owned_by_a_job_goes_with_it(
    cluster: FakeCluster, api: client.ApiClient, policy: str | None, left: bool
) -> None:
    cluster.script = lambda job: RunUntilDeleted()
    batch, core = client.BatchV1Api(api), client.CoreV1Api(api)
    job = await batch.create_namespaced_job(NS, inputs_job("owner"))
    owner = {"apiVersion": "batch/v1", "kind": "Job", "name": "owner", "uid": job.metadata.uid}
    body = secret_body("owner", {"inputs.json": b"{}"}, immutable=True, type="Opaque")
    body["metadata"]["ownerReferences"] = [owner]
    await core.create_namespaced_secret(NS, body)
    await core.create_namespaced_secret(NS, secret_body("bystander", {"k": b"v"}))
    await cluster.wait_for(lambda: cluster.jobs["owner"]["status"].get("ready") == 1)
    await batch.delete_namespaced_job("owner", NS, propagation_policy=policy)
    if left:  # orphaned: it stays, without the owner reference
        await cluster.wait_for(
            lambda: "ownerReferences" not in cluster.secrets["owner"]["metadata"]
        )
    else:
        await cluster.wait_for(lambda: "owner" not in cluster.secrets)
        await cluster.wait_for(lambda: not cluster.pods_of("owner"))
    assert "bystander" in cluster.secrets


async def test_a_pod_waits_in_container_creating_until_its_secret_exists(
    cluster: FakeCluster, api: client.ApiClient
) -> None:
    def output(files: dict[str, str]) -> str:
        return json.dumps({"doubled": 2 * json.loads(files["/var/run/sked/inputs.json"])["n"]})

    cluster.script = lambda job: Succeed(message=output)
    await client.BatchV1Api(api).create_namespaced_job(NS, inputs_job("held"))
    pod = (await cluster.wait_for(lambda: cluster.pods_of("held")))[0]["metadata"]["name"]
    await cluster.wait_for(lambda: cluster.pods[pod]["spec"].get("nodeName"))
    await asyncio.sleep(0.3)  # many steps of the driver: it still waits
    status = cluster.pods[pod]["status"]
    assert status["phase"] == "Pending"
    assert _waiting(cluster.pods[pod]) == {"reason": "ContainerCreating"}
    assert _condition(cluster.pods[pod], "PodReadyToStartContainers")["status"] == "False"
    assert "conditions" not in cluster.jobs["held"]["status"]
    assert cluster.files(pod) == {}
    with pytest.raises(ApiException) as not_started:
        await client.CoreV1Api(api).read_namespaced_pod_log(pod, NS)
    assert not_started.value.status == 400
    await client.CoreV1Api(api).create_namespaced_secret(NS, secret_body("other", {"k": b"v"}))
    await asyncio.sleep(0.1)
    assert cluster.pods[pod]["status"]["phase"] == "Pending"

    loop = asyncio.get_running_loop()
    body = secret_body("held", {"inputs.json": b'{"n": 21}'}, immutable=True)
    await client.CoreV1Api(api).create_namespaced_secret(NS, body)
    created_at = loop.time()
    await cluster.wait_for(lambda: cluster.pods[pod]["status"]["phase"] != "Pending")
    assert loop.time() - created_at < 0.2  # woken by the event, not by a slow poll
    await cluster.wait_for(lambda: _with_condition(cluster.jobs["held"], "Complete"))
    assert cluster.files(pod) == {"/var/run/sked/inputs.json": '{"n": 21}'}
    assert terminated(cluster, pod)["message"] == '{"doubled": 42}'


async def test_a_pod_deleted_while_waiting_for_its_secret_fails_the_job(
    cluster: FakeCluster, api: client.ApiClient
) -> None:
    await client.BatchV1Api(api).create_namespaced_job(NS, inputs_job("never-fed"))
    pod = (await cluster.wait_for(lambda: cluster.pods_of("never-fed")))[0]["metadata"]["name"]
    await cluster.wait_for(lambda: _waiting(cluster.pods[pod]).get("reason"))
    await client.CoreV1Api(api).delete_namespaced_pod(pod, NS)
    job = await cluster.wait_for(lambda: _with_condition(cluster.jobs["never-fed"], "Failed"))
    assert _condition(job, "Failed")["reason"] == "BackoffLimitExceeded"
    assert cluster.files(pod) == {}


async def test_secret_volumes_honour_items_and_optional(
    cluster: FakeCluster, api: client.ApiClient
) -> None:
    batch = client.BatchV1Api(api)
    await client.CoreV1Api(api).create_namespaced_secret(
        NS, secret_body("many", {"a": b"1", "b": b"2"})
    )
    await batch.create_namespaced_job(
        NS, inputs_job("mapped", "many", items=[{"key": "b", "path": "sub/bee.txt"}])
    )
    await batch.create_namespaced_job(NS, inputs_job("whole", "many"))
    await batch.create_namespaced_job(NS, inputs_job("maybe", "absent", optional=True))
    await batch.create_namespaced_job(NS, job_body("plain"))
    names = ("mapped", "whole", "maybe", "plain")
    await cluster.wait_for(lambda: all(_with_condition(cluster.jobs[n], "Complete") for n in names))
    files = {n: cluster.files(cluster.pods_of(n)[0]["metadata"]["name"]) for n in names}
    assert files == {
        "mapped": {"/var/run/sked/sub/bee.txt": "2"},
        "whole": {"/var/run/sked/a": "1", "/var/run/sked/b": "2"},
        "maybe": {},
        "plain": {},
    }
    # a key that `items` names and the Secret lacks holds the pod, as a missing Secret does
    await batch.create_namespaced_job(
        NS, inputs_job("lacking", "many", items=[{"key": "c", "path": "c"}])
    )
    pod = (await cluster.wait_for(lambda: cluster.pods_of("lacking")))[0]["metadata"]["name"]
    await cluster.wait_for(lambda: cluster.pods[pod]["spec"].get("nodeName"))
    await asyncio.sleep(0.3)
    assert _waiting(cluster.pods[pod]) == {"reason": "ContainerCreating"}


async def _run_body(cluster: FakeCluster, scenario: Scenario, body: dict[str, Any]) -> str:
    """Run the Job `body` through `scenario` to its end; the pod's name."""
    cluster.script = lambda _: scenario
    async with client.ApiClient(cluster.configuration()) as api:
        await client.BatchV1Api(api).create_namespaced_job(NS, body)
        if body["spec"]["template"]["spec"].get("volumes"):
            secret = secret_body(body["metadata"]["name"], {"inputs.json": b"{}"})
            await client.CoreV1Api(api).create_namespaced_secret(NS, secret)
    name = body["metadata"]["name"]
    pod = (await cluster.wait_for(lambda: cluster.pods_of(name)))[0]["metadata"]["name"]
    await cluster.wait_for(
        lambda: any(_find(cluster.jobs[name], kind) for kind in ("Complete", "Failed"))
    )
    return str(pod)


async def test_the_termination_message_keeps_the_last_4096_bytes(cluster: FakeCluster) -> None:
    written = "é" + "x" * 4092 + "end"  # 4097 bytes: the cut falls inside the 2-byte "é"
    pod = await _run_body(cluster, Succeed(message=written, log="a log\n"), inputs_job("cut"))
    message = terminated(cluster, pod)["message"]
    assert message == "\ufffd" + "x" * 4092 + "end"  # as Go's JSON encoder sends a cut rune
    assert len(message.encode()) == 4096 + 2  # the lone byte left of "é" became 3 bytes
    exact = "y" * 4096
    pod = await _run_body(cluster, Succeed(message=exact), inputs_job("exact"))
    assert terminated(cluster, pod)["message"] == exact


LOG = "".join(f"line {n:03}: {'z' * 20}\n" for n in range(100))  # 100 lines of 30 bytes


@pytest.mark.parametrize(
    ("scenario", "policy", "expected"),
    [
        # what the container wrote wins, failed or not
        (Fail(exit_code=2, message="why", log=LOG), "FallbackToLogsOnError", "why"),
        (Succeed(message="out", log=LOG), "FallbackToLogsOnError", "out"),
        # nothing written: a failure falls back to its log's last 80 lines, then 2048 bytes
        (Fail(exit_code=2, log=LOG), "FallbackToLogsOnError", LOG.encode()[-2048:].decode()),
        (Fail(exit_code=2, log="one\ntwo"), "FallbackToLogsOnError", "one\ntwo"),
        # no fallback for a success, nor under the File policy, nor with an empty log
        (Succeed(log=LOG), "FallbackToLogsOnError", None),
        (Fail(exit_code=2, log=LOG), "File", None),
        (Fail(exit_code=2), "FallbackToLogsOnError", None),
    ],
    ids=[
        "fail-written",
        "succeed-written",
        "fail-log",
        "fail-short-log",
        "succeed-log",
        "fail-file-policy",
        "fail-no-log",
    ],
)
async def test_the_termination_message_falls_back_to_the_log_only_on_failure(
    cluster: FakeCluster, scenario: Scenario, policy: str, expected: str | None
) -> None:
    body = inputs_job("msg")
    body["spec"]["template"]["spec"]["containers"][0]["terminationMessagePolicy"] = policy
    pod = await _run_body(cluster, scenario, body)
    assert terminated(cluster, pod).get("message") == expected


async def test_the_log_fallback_counts_80_lines_before_2048_bytes(cluster: FakeCluster) -> None:
    short = "".join(f"{n}\n" for n in range(200))  # 80 lines hold far fewer than 2048 bytes
    pod = await _run_body(cluster, Fail(exit_code=1, log=short), inputs_job("lines"))
    assert terminated(cluster, pod)["message"] == "".join(f"{n}\n" for n in range(120, 200))


async def test_a_killed_container_falls_back_to_its_log_too(cluster: FakeCluster) -> None:
    scenario = DeadlineExceeded(after_s=0.05, log="last words\n")
    events: list[Event] = []
    cluster.api.listeners.append(events.append)
    pod = await _run_body(cluster, scenario, inputs_job("killed"))
    killed = [
        s["state"]["terminated"]
        for e in events
        if e.obj["metadata"]["name"] == pod
        for s in e.obj["status"].get("containerStatuses") or []
        if "terminated" in s["state"]
    ]
    assert killed[-1]["exitCode"] == 143
    assert killed[-1]["message"] == "last words\n"


async def test_secret_flows_write_schema_valid_objects(cluster: FakeCluster) -> None:
    events: list[Event] = []
    cluster.api.listeners.append(events.append)
    await _run_body(cluster, Fail(exit_code=3, log="boom\n"), inputs_job("valid"))
    assert any(e.obj["kind"] == "Secret" for e in events)
    for event in events:
        kubernetes_validate.validate(event.obj, "1.31", strict=True)
