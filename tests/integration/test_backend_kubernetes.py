"""The Kubernetes backend against a fake API server over real HTTP (tests/fakes/kube.py) whose
driver creates each Job's pod and walks it through a scenario: launch, outcomes, launch
failures, fencing, idempotent creates, stop, timeout, watches that break, the loss ladder, and
a workflow task's data flow (inputs in a Secret, output in the termination message)."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import kmock
import pytest

from services.executor.backends import Launch
from services.executor.backends.kubernetes import KubernetesBackend
from shared.models import CommandJob, Resources
from tests.fakes.kube import (
    Evicted,
    Fail,
    FakeCluster,
    ImageNotFound,
    ImagePullBackOff,
    RunUntilDeleted,
    Succeed,
    Unschedulable,
    fake_cluster,
)
from tests.fakes.kube_backend import NS, on_cluster, run
from tests.fakes.kube_backend import job_of as _job


@pytest.fixture
async def cluster() -> AsyncIterator[FakeCluster]:
    async with fake_cluster() as c:
        c.add_node("n1", cpu="4", memory="8Gi")
        c.add_node("gpu1", cpu="8", memory="32Gi", gpu=2)
        yield c


@pytest.fixture
async def backend(cluster: FakeCluster) -> AsyncIterator[KubernetesBackend]:
    async with on_cluster(cluster) as b:
        yield b


def launch(
    attempt: int = 1,
    node: str = "n1",
    timeout_s: float | None = None,
    task_id: uuid.UUID | None = None,
    gpu: int = 0,
) -> Launch:
    return Launch(
        task_id or uuid.uuid4(),
        attempt,
        CommandJob(argv=["python", "-c", "print(1)"], image="python:3.12", env={"K": "v"}),
        timeout_s,
        {"SKED_HEARTBEAT_URL": "http://monitor/heartbeat"},
        node=node,
        resources=Resources(cpu=0.5, memory_mb=256, gpu=gpu),
    )


def by_name(cluster: FakeCluster, what: Launch) -> dict[str, Any]:
    return cluster.created_jobs[[_name(j) for j in cluster.created_jobs].index(_job(what))]


def _name(job: dict[str, Any]) -> str:
    return str(job["metadata"]["name"])


async def test_the_cluster_nodes_are_offered_as_they_stand(
    cluster: FakeCluster, backend: KubernetesBackend
) -> None:
    offers = backend.offers()
    assert set(offers) == {"n1", "gpu1"}
    assert (offers["gpu1"].gpu, offers["gpu1"].cpu, offers["gpu1"].memory_mb) == (2, 8.0, 32768)
    assert offers["n1"].ready
    cluster.cordon("n1")
    await cluster.wait_for(lambda: not backend.offers()["n1"].ready)
    cluster.set_node_ready("gpu1", False)
    await cluster.wait_for(lambda: not backend.offers()["gpu1"].ready)


async def test_an_attempt_runs_as_one_job_on_its_node_and_succeeds(
    cluster: FakeCluster, backend: KubernetesBackend
) -> None:
    cluster.script = lambda job: Succeed(log="hello from the pod\n")
    what = launch(node="gpu1", gpu=1)
    outcome = await run(backend, what)
    assert (outcome.ok, outcome.result, outcome.error) == (True, {"exit_code": 0}, None)
    assert "hello from the pod" in outcome.log_tail
    job = by_name(cluster, what)
    pod = job["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"kubernetes.io/hostname": "gpu1"}
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert [p["spec"]["nodeName"] for p in cluster.pods_of(_job(what))] == ["gpu1"]
    assert cluster.create_counts[_job(what)] == 1


async def test_an_exit_code_fails_the_attempt(
    cluster: FakeCluster, backend: KubernetesBackend
) -> None:
    cluster.script = lambda job: Fail(exit_code=3, log="boom\n")
    outcome = await run(backend, launch())
    assert (outcome.ok, outcome.result) == (False, {"exit_code": 3})
    # the log's end stands in for the termination message a failure did not write
    assert outcome.error == "exit code 3 (Error: boom)"
    assert (outcome.lost, outcome.unstarted) == (False, False)


async def test_a_create_stored_but_answered_500_is_adopted_on_409(
    cluster: FakeCluster, backend: KubernetesBackend
) -> None:
    cluster.fail_next_create()
    what = launch()
    outcome = await run(backend, what)
    assert outcome.ok
    assert cluster.create_counts[_job(what)] == 1  # stored once
    assert cluster.create_attempts[_job(what)] == 2  # the retry met 409 and adopted it
    assert await backend.launcher.book.recorded(what.task_id, what.attempt)


async def test_a_stranger_by_the_same_name_is_not_adopted(
    cluster: FakeCluster, backend: KubernetesBackend
) -> None:
    what = launch()
    body = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": _job(what), "namespace": NS, "labels": {"app": "other"}},
        "spec": {
            "template": {
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [{"name": "c", "image": "busybox"}],
                }
            }
        },
    }
    cluster.script = lambda job: RunUntilDeleted()
    await backend.kube.create_job(body)
    outcome = await run(backend, what)
    assert outcome.final
    assert "not this attempt's" in (outcome.error or "")


async def test_image_pull_back_off_and_unschedulable_are_launch_failures(
    cluster: FakeCluster, backend: KubernetesBackend
) -> None:
    cluster.script = lambda job: ImagePullBackOff()
    pulled = await run(backend, launch())
    assert (pulled.unstarted, pulled.final) == (True, False)
    assert "ImagePullBackOff" in (pulled.error or "")
    cluster.script = lambda job: Unschedulable()
    stuck = await run(backend, launch())
    assert stuck.unstarted
    assert "Unschedulable" in (stuck.error or "")
    # the Jobs of attempts that never started are deleted
    await cluster.wait_for(lambda: not cluster.jobs, timeout=5)


async def test_an_image_that_does_not_exist_fails_at_once(
    cluster: FakeCluster, backend: KubernetesBackend
) -> None:
    cluster.script = lambda job: ImageNotFound()
    loop = asyncio.get_running_loop()
    began = loop.time()
    outcome = await run(backend, launch())
    assert (outcome.unstarted, outcome.final) == (False, True)
    assert "not found" in (outcome.error or "")
    assert loop.time() - began < 1.0  # not after the start budget: at once


async def test_an_evicted_pod_is_lost(cluster: FakeCluster, backend: KubernetesBackend) -> None:
    cluster.script = lambda job: Evicted(after_s=0.2, reason="TerminationByKubelet")
    outcome = await run(backend, launch())
    assert outcome.lost
    assert "TerminationByKubelet" in (outcome.error or "")


async def test_the_run_timeout_deletes_the_job_and_its_pods(
    cluster: FakeCluster, backend: KubernetesBackend
) -> None:
    cluster.script = lambda job: RunUntilDeleted(log="working\n")
    what = launch(timeout_s=0.5)
    outcome = await run(backend, what)
    assert outcome.timed_out
    await cluster.wait_for(lambda: not cluster.jobs and not cluster.pods, timeout=5)


async def test_stop_deletes_the_job_and_ends_once_the_pods_are_gone(
    cluster: FakeCluster, backend: KubernetesBackend
) -> None:
    cluster.script = lambda job: RunUntilDeleted()
    what = launch()
    running = asyncio.create_task(run(backend, what))
    await cluster.wait_for(
        lambda: any(p["status"].get("phase") == "Running" for p in cluster.pods_of(_job(what)))
    )
    assert await backend.stop_task(what.task_id, what.attempt)
    outcome = await running
    assert outcome.stopped
    assert not cluster.pods_of(_job(what))
    assert _job(what) not in cluster.jobs


async def test_a_next_attempt_is_created_only_after_the_old_pods_are_gone(
    cluster: FakeCluster, backend: KubernetesBackend
) -> None:
    cluster.gc_delay_s = 0.5  # the old pods linger a while after their Job is deleted
    cluster.script = lambda job: (
        RunUntilDeleted() if job["metadata"]["name"].endswith("-1") else Succeed()
    )
    task_id = uuid.uuid4()
    first = launch(1, task_id=task_id)
    old = asyncio.create_task(run(backend, first))
    await cluster.wait_for(lambda: cluster.pods_of(_job(first)))
    events: list[tuple[int, str, str, str]] = []
    cluster.api.listeners.append(
        lambda e: events.append((e.rv, e.type, e.obj["kind"], e.obj["metadata"]["name"]))
    )
    second = launch(2, task_id=task_id)
    assert (await run(backend, second)).ok
    old_pods_gone = max(
        v for v, t, k, n in events if k == "Pod" and t == "DELETED" and n.startswith(_job(first))
    )
    new_job_created = min(
        v for v, t, k, n in events if k == "Job" and t == "ADDED" and n == _job(second)
    )
    assert old_pods_gone < new_job_created
    assert (await old).lost  # attempt 1's Job was taken away under it


async def test_broken_watches_resync_and_miss_no_outcome(
    cluster: FakeCluster, backend: KubernetesBackend
) -> None:
    cluster.script = lambda job: Succeed(after_s=0.6)
    whats = [launch() for _ in range(4)]
    runs = [asyncio.create_task(run(backend, w)) for w in whats]
    await cluster.wait_for(lambda: len(cluster.jobs) == 4)
    lists = backend.jobs.lists
    cluster.expire_next_watch(count=3)  # the next watches are answered 410
    cluster.cut_watches(abrupt=True)  # and the current ones are cut mid-stream
    outcomes = await asyncio.gather(*runs)
    assert all(o.ok for o in outcomes)
    assert backend.jobs.lists > lists  # listed afresh rather than trusting the watch


async def test_a_node_that_turns_not_ready_climbs_the_ladder_before_lost(
    cluster: FakeCluster, backend: KubernetesBackend
) -> None:
    cluster.script = lambda job: RunUntilDeleted(log="step 1\n")
    what = launch()
    running = asyncio.create_task(run(backend, what))
    await cluster.wait_for(
        lambda: any(p["status"].get("phase") == "Running" for p in cluster.pods_of(_job(what)))
    )
    cluster.set_node_ready("n1", False)
    outcome = await asyncio.wait_for(running, 10)
    assert outcome.lost
    reason = outcome.error or ""
    assert "node n1 NotReady" in reason
    assert "Job and pod: running" in reason
    assert "log unchanged" in reason


async def test_a_job_that_vanished_after_launch_is_lost_and_never_recreated(
    cluster: FakeCluster, backend: KubernetesBackend
) -> None:
    cluster.script = lambda job: RunUntilDeleted()
    what = launch()
    running = asyncio.create_task(run(backend, what))
    await cluster.wait_for(lambda: cluster.pods_of(_job(what)))
    await backend.kube.delete_job(_job(what))  # someone else deleted it
    assert (await asyncio.wait_for(running, 10)).lost
    # the same attempt delivered again: never created twice
    again = await run(backend, what)
    assert again.lost
    assert cluster.create_counts[_job(what)] == 1


# -- workflow data flow: inputs in a Secret of the attempt's own, output in the termination message

INPUTS = "/var/run/sked/inputs.json"
SECRETS = kmock.resource("v1/secrets")


def with_inputs(inputs: object, **kw: Any) -> Launch:
    return replace(launch(**kw), inputs=inputs)


def env_of(cluster: FakeCluster, what: Launch) -> dict[str, str]:
    container = by_name(cluster, what)["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e["value"] for e in container["env"]}


def echo_inputs(files: dict[str, str]) -> str:
    """A task that declares as its output what it found in $SKED_INPUTS."""
    return json.dumps({"got": json.loads(files[INPUTS])})


async def test_a_workflow_tasks_inputs_reach_its_pod_in_a_secret_its_job_owns(
    cluster: FakeCluster, backend: KubernetesBackend
) -> None:
    cluster.script = lambda job: Succeed(message=echo_inputs)
    inputs = {"extract": {"rows": 3}}
    what = with_inputs(inputs)
    outcome = await run(backend, what)
    assert (outcome.ok, outcome.result) == (True, {"exit_code": 0, "output": {"got": inputs}})
    env = env_of(cluster, what)
    assert env["SKED_INPUTS"] == INPUTS
    assert json.loads(env["SKED_INPUTS_JSON"]) == inputs  # small: in the variable too
    secret, job = cluster.secrets[_job(what)], cluster.jobs[_job(what)]
    assert [r["uid"] for r in secret["metadata"]["ownerReferences"]] == [job["metadata"]["uid"]]
    await backend.kube.delete_job(_job(what))  # as its TTL would: the Secret goes with it
    await cluster.wait_for(lambda: _job(what) not in cluster.secrets, timeout=5)


async def test_inputs_too_large_for_a_variable_still_reach_the_task_in_its_file(
    cluster: FakeCluster, backend: KubernetesBackend
) -> None:
    """Over 128 KiB, a variable cannot carry them (execve refuses it): the file does, up to
    the 1 MiB a Secret holds, and the variable is left out past 64 KiB."""
    cluster.script = lambda job: Succeed(message=lambda files: str(len(files[INPUTS])))
    inputs = {"extract": "x" * (200 * 1024)}
    what = with_inputs(inputs)
    outcome = await run(backend, what)
    assert outcome.ok, outcome
    assert outcome.result["output"] == len(json.dumps(inputs, separators=(",", ":")))
    assert "SKED_INPUTS_JSON" not in env_of(cluster, what)


async def test_inputs_over_what_a_secret_holds_fail_the_task_once_before_any_job(
    cluster: FakeCluster, backend: KubernetesBackend
) -> None:
    what = with_inputs({"extract": "x" * (1024 * 1024)})
    outcome = await run(backend, what)
    assert (outcome.ok, outcome.final) == (False, True), outcome
    assert "Secret" in str(outcome.error), outcome
    assert "1048576" in str(outcome.error), outcome
    assert cluster.create_attempts[_job(what)] == 0


async def test_a_command_without_inputs_gets_no_secret_and_may_declare_an_output(
    cluster: FakeCluster, backend: KubernetesBackend
) -> None:
    cluster.script = lambda job: Succeed(message='{"rows": 41}\n')
    what = launch()
    outcome = await run(backend, what)
    assert outcome.result == {"exit_code": 0, "output": {"rows": 41}}
    assert "SKED_INPUTS" not in env_of(cluster, what)
    assert env_of(cluster, what)["SKED_OUTPUT"] == "/dev/sked-output"
    assert _job(what) not in cluster.secrets
    cluster.script = lambda job: Succeed()  # wrote nothing: declared nothing
    assert (await run(backend, launch())).result == {"exit_code": 0}


@pytest.mark.parametrize(
    ("message", "why"),
    [
        ("[" + "1," * 3000 + "1]", "4096 bytes"),  # what the kubelet keeps may be cut
        ("all done", "not JSON"),
        ('{"x": NaN}', "NaN"),
    ],
)
async def test_a_declared_output_sked_cannot_take_fails_the_attempt_saying_why(
    cluster: FakeCluster, backend: KubernetesBackend, message: str, why: str
) -> None:
    cluster.script = lambda job: Succeed(message=message)
    outcome = await run(backend, launch())
    assert not outcome.ok, outcome
    assert why in str(outcome.error), outcome
    assert "$SKED_OUTPUT" in str(outcome.error), outcome
    assert not outcome.final  # a retry may write it right


@pytest.mark.parametrize(("status", "final"), [(403, False), (422, True)])
async def test_a_secret_refused_deletes_the_job_and_fails_the_launch(
    cluster: FakeCluster, backend: KubernetesBackend, status: int, final: bool
) -> None:
    """A 403 (the role lacks `secrets: create`) can be mended, so the task goes back to Ready;
    an invalid Secret cannot. Either way no pod is left waiting for a Secret that never comes."""
    cluster.script = lambda job: Succeed()
    cluster.fail_next_create(SECRETS, status=status, stored=False)
    what = with_inputs({"a": 1})
    outcome = await run(backend, what)
    assert (outcome.ok, outcome.final, outcome.unstarted) == (False, final, not final), outcome
    assert "Secret" in str(outcome.error), outcome
    await cluster.wait_for(
        lambda: _job(what) not in cluster.jobs and not cluster.pods_of(_job(what))
    )


async def test_a_secret_create_cut_off_is_tried_again(
    cluster: FakeCluster, backend: KubernetesBackend
) -> None:
    """Stored but answered 500: the next create meets it (409), remakes it, and the task runs."""
    cluster.script = lambda job: Succeed(message=echo_inputs)
    cluster.fail_next_create(SECRETS, status=500, stored=True)
    outcome = await run(backend, with_inputs({"a": 1}))
    assert outcome.result == {"exit_code": 0, "output": {"got": {"a": 1}}}, outcome
