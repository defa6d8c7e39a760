"""The Kubernetes backend's workflow data flow (inputs in a per-attempt Secret, the declared
output in the termination message) against hostile or unlucky clusters, on the fake API
server. Each case was found by an adversarial review of the first version (5e6753c), where it
failed: the docstrings say what happened; each test shows it no longer does."""

from __future__ import annotations

import asyncio
import base64
import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import kmock
import pytest
from pydantic_core import to_json

import tests.fakes.kube as fakekube
from services.executor.backends import Launch
from services.executor.backends.kubernetes import KubernetesBackend
from services.executor.backends.kubernetes.kube import KubeError
from shared.models import CommandJob, Resources
from tests.fakes.kube import FakeCluster, RunUntilDeleted, Succeed, fake_cluster
from tests.fakes.kube_backend import NS, on_cluster, run
from tests.fakes.kube_backend import job_of as _job

INPUTS = "/var/run/sked/inputs.json"
SECRETS = kmock.resource("v1/secrets")


@pytest.fixture
async def cluster() -> AsyncIterator[FakeCluster]:
    async with fake_cluster() as c:
        c.add_node("n1", cpu="4", memory="8Gi")
        yield c


@pytest.fixture
async def backend(cluster: FakeCluster) -> AsyncIterator[KubernetesBackend]:
    async with on_cluster(cluster) as b:
        yield b


def launch(inputs: object = None, attempt: int = 1) -> Launch:
    return Launch(
        uuid.uuid4(),
        attempt,
        CommandJob(argv=["python", "-c", "print(1)"], image="python:3.12", env={"K": "v"}),
        None,
        {"SKED_HEARTBEAT_URL": "http://monitor/heartbeat"},
        inputs,
        node="n1",
        resources=Resources(cpu=0.5, memory_mb=256),
    )


def echo_inputs(files: dict[str, str]) -> str:
    return json.dumps({"got": json.loads(files[INPUTS])})


def seen_by_pods(cluster: FakeCluster, job: str) -> list[dict[str, str]]:
    """The files every pod of `job` saw when its container started (a pod that never started:
    {}), its pods deleted since included."""
    return [dict(r.files) for (_, _), r in cluster._runs.items() if r.name == job]


# -- 1. a delete refused (RBAC) or failed after a 409 -------------------------------------------


@pytest.mark.parametrize("status", [403, 500])
async def test_a_failed_delete_after_a_409_fails_the_launch_and_leaves_its_job_running(
    cluster: FakeCluster,
    backend: KubernetesBackend,
    monkeypatch: pytest.MonkeyPatch,
    status: int,
) -> None:
    """The Secret create is stored but answered 500 (the case the 409 path exists for); the
    retry meets it (409) and the delete that should clear it is answered 403 (the role lacks
    `secrets: delete`) or 500. `_give_inputs` calls `delete_secret` inside its
    `except KubeError` handler, so that error escapes the loop: the "a Secret not made deletes
    the Job" path was skipped, `run()` reported a launch failure (unstarted: the task goes back
    to Ready, no retry spent), and the Job, unrecorded and unfollowed, ran on: its pod found
    its Secret and started. The next dispatch would run the task a second time beside it. A
    500 on a delete is an outage like any other and was not even tried again.

    Now the delete after a 409 is judged as the create is (`_create_patiently`: tried again
    after an outage, given up on a refusal), and any way the Secret is not made deletes the
    Job."""
    cluster.script = lambda job: RunUntilDeleted()
    cluster.fail_next_create(SECRETS, status=500, stored=True)
    what = launch({"a": 1})

    async def refused(name: str) -> bool:
        raise KubeError(status, json.dumps({"message": f"secrets {name!r} delete: {status}"}))

    monkeypatch.setattr(backend.kube, "delete_secret", refused)
    outcome = await run(backend, what)
    assert not outcome.ok  # the launch failed (a 403 cannot be got round) ...
    # ... and a failed launch leaves no Job behind to run unrecorded
    await cluster.wait_for(lambda: _job(what) not in cluster.jobs, timeout=3)


async def test_a_pod_starts_on_the_stale_secret_before_it_is_replaced(
    cluster: FakeCluster, backend: KubernetesBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Secret of the attempt's name is already there (a stranger's, a key reused after
    retention whose old Secret outlived its Job, one orphaned by `--cascade=orphan`). The
    launcher makes the Job FIRST; its pod mounts whatever Secret of that name exists, so it
    could start on the stale one before `_give_inputs` had met the 409, deleted it and made the
    new one. With a delete taking 0.3 s (API latency) the task ran on the stale inputs and its
    output was computed from them.

    Now the pod mounts the Secret's key named by its inputs' hash (job_manifest): a Secret
    without these very inputs cannot be mounted, and the pod waits for its own."""
    cluster.script = lambda job: Succeed(message=echo_inputs)
    what = launch({"fresh": True})
    stale = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": _job(what), "namespace": NS},
        "data": {"inputs.json": base64.b64encode(b'{"stale": true}').decode()},
    }
    cluster.api.create(SECRETS, NS, stale)
    real_delete = backend.kube.delete_secret

    async def slow_delete(name: str) -> bool:
        await asyncio.sleep(0.3)
        return await real_delete(name)

    monkeypatch.setattr(backend.kube, "delete_secret", slow_delete)
    outcome = await run(backend, what)
    assert outcome.result == {"exit_code": 0, "output": {"got": {"fresh": True}}}, outcome
    owners = cluster.secrets[_job(what)]["metadata"]["ownerReferences"]
    assert [r["uid"] for r in owners] == [cluster.jobs[_job(what)]["metadata"]["uid"]]


# -- 2. the Job's Complete seen before its pod's terminated status -----------------------------


async def test_a_job_complete_seen_before_its_pod_status_loses_the_declared_output(
    cluster: FakeCluster, backend: KubernetesBackend
) -> None:
    """The Job and pod informers are two watch streams; nothing orders one after the other
    (the pods stream carries every status change of every pod, and re-lists after a drop). If
    the Job's Complete arrives while the pod cache still holds the pod Pending (or not at all),
    `judge` skips the pod (waiting ContainerCreating is no verdict) and returns
    Verdict("exited", "Complete", exit_code=0) with message None; `exited` logged a warning and
    reported success with NO output: the declared output was silently lost and the downstream
    tasks got null. Here the pod stream runs 0.5 s behind the Job stream.

    Now a success with no message seen reads the attempt's pods from the API before deciding:
    only a pod the API says is gone declares nothing."""
    loop = asyncio.get_running_loop()
    prompt = backend.pods._apply

    def late(kind: str, obj: dict[str, Any]) -> str | None:
        loop.call_later(0.5, prompt, kind, obj)
        version = (obj.get("metadata") or {}).get("resourceVersion")
        return str(version) if version else None

    backend.pods._apply = late  # type: ignore[method-assign]
    cluster.script = lambda job: Succeed(message='{"rows": 41}', after_s=0.05)
    outcome = await run(backend, launch())
    assert outcome.result == {"exit_code": 0, "output": {"rows": 41}}, outcome


# -- 3. inputs measured as escaped, spaced JSON -------------------------------------------------


@pytest.mark.parametrize(
    "inputs",
    [
        {"extract": "é" * 200_000},  # 0.4 MB as sked measures it; 1.2 MB as \u00e9 escapes
        # 0.72 MB compact; 1.08 MB with json.dumps' ", " separators (kept so that the Secret's
        # request body stays under aiohttp's 1 MiB ResourceWarning, an error in this suite)
        {"extract": [0] * 360_000},
    ],
    ids=["non-ascii", "separators"],
)
async def test_inputs_well_under_what_a_secret_holds_are_refused_as_over_it(
    cluster: FakeCluster, backend: KubernetesBackend, inputs: dict[str, Any]
) -> None:
    """sked measures inputs as compact UTF-8 JSON (dag.inputs_too_large: pydantic to_json);
    `Launcher.launch` measures `json.dumps(inputs)`: ASCII-escaped (6 bytes per 'é', 12 per
    emoji) and with ", " / ": " separators. Inputs whose JSON is well under 1 MiB as sked
    itself counts them, and that a Secret would hold, failed the task PERMANENTLY ("the task's
    inputs are 1200013 bytes of JSON; ... holds at most 1048576"), before any Job. Now they are
    measured, and written, as compact UTF-8 (`launch.compact`)."""
    assert len(to_json(inputs)) < 1024 * 1024  # what sked's own limits measure
    cluster.script = lambda job: Succeed(message=lambda files: str(len(files[INPUTS])))
    outcome = await run(backend, launch(inputs))
    assert outcome.ok, outcome


# -- 4. the pod-wide termination message budget (sidecars) -------------------------------------


async def test_a_message_cut_to_the_pod_wide_budget_is_taken_as_the_output(
    cluster: FakeCluster, backend: KubernetesBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kubelet keeps the last 4096 bytes of the file, and then its status manager
    (pkg/kubelet/status normalizeStatus) keeps the FIRST 12288 / (containers + initContainers)
    bytes of each terminated message. A pod that a mesh's webhook gives istio-init and
    istio-proxy, plus one more sidecar, has 4 containers: 3072 bytes each. A task that declares
    3500 bytes (a number, or any JSON still valid once cut) got its first 3072 bytes taken as
    its output: `declared_output` only refused >= 4096, so a cut value below it passed as what
    the task wrote (here a 3072-digit number for a 3500-digit one). Now the cap is the pod's
    (`manifest.message_cap`, from its spec: the containers sharing the budget) and a message
    reaching it fails the attempt, saying so."""
    real_pod_for = cluster._pod_for

    def injected(job: dict[str, Any]) -> dict[str, Any]:  # what a mutating webhook does
        pod = real_pod_for(job)
        spec = pod["spec"]
        spec["containers"] += [
            {"name": "istio-proxy", "image": "istio/proxyv2"},
            {"name": "vault-agent", "image": "hashicorp/vault"},
        ]
        spec["initContainers"] = [{"name": "istio-init", "image": "istio/proxyv2"}]
        return pod

    monkeypatch.setattr(cluster, "_pod_for", injected)
    kubelet = fakekube._termination_message
    per_container = 12 * 1024 // 4

    def budgeted(container: dict[str, Any], written: str, log: str, exit_code: int) -> str:
        whole = kubelet(container, written, log, exit_code).encode()
        return whole[:per_container].decode("utf-8", errors="replace")

    monkeypatch.setattr(fakekube, "_termination_message", budgeted)
    written = "7" * 3500
    cluster.script = lambda job: Succeed(message=written)
    outcome = await run(backend, launch())
    taken = outcome.result.get("output") if outcome.ok else None
    assert taken != int("7" * 3072), f"a cut number was taken as the output: {outcome.error}"


# -- 5. a stop in the window between the Job and its Secret ------------------------------------


async def test_a_stop_between_the_job_and_its_secret_still_hands_the_pod_its_inputs(
    cluster: FakeCluster, backend: KubernetesBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The task is canceled (stop_task) just after its Job was made and before its Secret:
    stop_task deletes the Job (Background: its pod goes when the garbage collector gets to it),
    then `_give_inputs` went on and created the Secret anyway (it never looked at
    `stopped()`), which is exactly what the pod was waiting for: the container started, and
    the canceled task ran, with its inputs, until the collector killed it. Now no Secret is
    made once stopped: the pod never starts."""
    cluster.script = lambda job: Succeed(message=echo_inputs, after_s=1.0)
    what = launch({"a": 1})
    real = backend.launcher._give_inputs

    async def stop_first(job: dict[str, Any], data: bytes, stopped: Callable[[], bool]) -> None:
        await backend.stop_task(what.task_id, what.attempt)
        await real(job, data, stopped)

    monkeypatch.setattr(backend.launcher, "_give_inputs", stop_first)
    outcome = await run(backend, what)
    assert outcome.stopped, outcome
    await asyncio.sleep(0.5)
    started = [f for f in seen_by_pods(cluster, _job(what)) if f]
    assert not started, f"a stopped attempt's container started: {started}"
