"""The Kubernetes backend against a hostile or flaky API server and hostile task specs, on the
fake API server: each case was found by an adversarial review (a canceled attempt's Job left
running, another container or pod deciding the outcome, a stranger's Job adopted, another
installation's Job deleted, a stop held up, nonsense stopping every launch, ...). The
docstrings say what happened; each test shows it no longer does."""

from __future__ import annotations

import asyncio
import json
import subprocess
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from services.executor.backends import Launch
from services.executor.backends.kubernetes import KubernetesBackend
from services.executor.backends.kubernetes.kube import LOG_READ_S, KubeError
from services.executor.backends.kubernetes.manifest import (
    JobOptions,
    job_manifest,
    labels,
)
from shared.models import CommandJob, Resources
from tests.fakes.kube import (
    JOBS,
    PODS,
    Fail,
    FakeCluster,
    ImagePullBackOff,
    RunUntilDeleted,
    Succeed,
    fake_cluster,
)
from tests.fakes.kube_backend import NS, on_cluster, run
from tests.fakes.kube_backend import job_of as _job


@pytest.fixture
async def cluster() -> AsyncIterator[FakeCluster]:
    async with fake_cluster() as c:
        c.add_node("n1", cpu="4", memory="8Gi")
        yield c


@pytest.fixture
async def backend(cluster: FakeCluster) -> AsyncIterator[KubernetesBackend]:
    async with on_cluster(cluster) as b:
        yield b


def launch(
    attempt: int = 1,
    task_id: uuid.UUID | None = None,
    *,
    image: str = "python:3.12",
    argv: list[str] | None = None,
    env: dict[str, str] | None = None,
    timeout_s: float | None = None,
) -> Launch:
    return Launch(
        task_id or uuid.uuid4(),
        attempt,
        CommandJob(argv=argv or ["python", "-c", "print(1)"], image=image, env=env or {"K": "v"}),
        timeout_s,
        {"SKED_HEARTBEAT_URL": "http://monitor/heartbeat"},
        node="n1",
        resources=Resources(cpu=0.5, memory_mb=256),
    )


def _running(cluster: FakeCluster, what: Launch) -> bool:
    return any(p["status"].get("phase") == "Running" for p in cluster.pods_of(_job(what)))


async def test_a_stop_during_the_launch_leaves_no_job_running(
    cluster: FakeCluster, backend: KubernetesBackend
) -> None:
    """Cancel while the create is being retried (5xx): stop_task deletes nothing (no Job yet),
    then the retried create makes the Job, run() returns "stopped" and the Job runs on."""
    cluster.script = lambda job: RunUntilDeleted()
    cluster.fail_next_create(status=503, stored=False, count=2)
    what = launch()
    running = asyncio.create_task(run(backend, what))
    await cluster.wait_for(lambda: cluster.create_attempts[_job(what)] >= 1)
    assert await backend.stop_task(what.task_id, what.attempt)  # canceled by the operator
    outcome = await running
    assert outcome.stopped
    await asyncio.sleep(1.0)
    left = sorted(cluster.jobs)
    assert _job(what) not in left, "a canceled attempt's Job was created and runs on"
    assert not cluster.pods_of(_job(what))


async def test_a_sidecar_listed_first_does_not_decide_the_outcome(
    cluster: FakeCluster, backend: KubernetesBackend
) -> None:
    """A mutating webhook injected a sidecar; the kubelet lists container statuses sorted by
    name, so "istio-init-helper" comes before "task". The sidecar exits 0 while the task still
    runs: status.py reads containerStatuses[0] and reports the attempt succeeded."""
    cluster.script = lambda job: RunUntilDeleted(log="working\n")
    what = launch()
    running = asyncio.create_task(run(backend, what))
    await cluster.wait_for(lambda: _running(cluster, what))
    pod = cluster.pods_of(_job(what))[0]

    def sidecar_done(p: dict[str, Any]) -> None:
        task = p["status"]["containerStatuses"][0]
        sidecar = {
            **task,
            "name": "istio-init-helper",
            "image": "proxy:1",
            "state": {"terminated": {"exitCode": 0, "reason": "Completed"}},
        }
        p["status"]["containerStatuses"] = [sidecar, task]  # the task is still running

    cluster.api.mutate(PODS, NS, pod["metadata"]["name"], sidecar_done)
    await asyncio.sleep(1.0)
    reported = running.result() if running.done() else None
    running.cancel()
    assert reported is None, f"the task still runs, yet it was reported: {reported}"


async def test_an_image_name_does_not_make_a_transient_pull_error_permanent(
    cluster: FakeCluster, backend: KubernetesBackend
) -> None:
    """The registry times out (a transient ImagePullBackOff); the runtime's message quotes the
    image reference, and the image's own name contains "denied": status.py's regex matches
    the name and fails the task at once, final, instead of a launch failure to try again."""
    cluster.script = lambda job: ImagePullBackOff()  # "dial tcp ...: i/o timeout"
    outcome = await run(
        backend, launch(image="registry.example.com/acme/denied-requests-exporter:1")
    )
    assert "i/o timeout" in (outcome.error or "")
    assert (outcome.unstarted, outcome.final) == (True, False), outcome.error


async def test_a_stop_is_not_held_up_by_a_pod_log_that_never_answers(
    cluster: FakeCluster, backend: KubernetesBackend
) -> None:
    """The pod's node is unreachable, so the API server's pods/log proxy hangs. stop_task reads
    the log before it deletes the Job, with no bound: the cancel never deletes the Job (and the
    watch loop that calls stop_task is stuck behind it)."""
    import kmock

    cluster.script = lambda job: RunUntilDeleted(log="working\n")
    what = launch()
    running = asyncio.create_task(run(backend, what))
    await cluster.wait_for(lambda: _running(cluster, what))
    release = asyncio.Event()

    async def hang(request: Any) -> bytes:
        await release.wait()
        return b""

    _ = cluster.api[kmock.method.GET, kmock.subresource("log")] << hang
    try:
        stopping = asyncio.create_task(backend.stop_task(what.task_id, what.attempt))
        await cluster.wait_for(lambda: _job(what) not in cluster.jobs, timeout=5)
        # the log's read, begun beside the delete, gives up at LOG_READ_S (5 s of a loaded
        # host's clock once held a 5 s window here past its end)
        async with asyncio.timeout(LOG_READ_S + 5):
            assert await stopping
    finally:
        release.set()
        running.cancel()


async def test_a_lost_attempts_orphaned_pod_does_not_block_the_next_attempt_forever(
    cluster: FakeCluster, backend: KubernetesBackend
) -> None:
    """Someone deletes the attempt's Job with propagationPolicy=Orphan (kubectl delete
    --cascade=orphan): attempt 1 is reported Lost, but its pod runs on, and nothing deletes
    it. The retry's fence deletes only older *Jobs* and then waits for their pods, which never
    go: every next attempt is a launch failure until the task fails for good."""
    cluster.script = lambda job: (
        RunUntilDeleted() if job["metadata"]["name"].endswith("-1") else Succeed()
    )
    task_id = uuid.uuid4()
    first = launch(1, task_id)
    old = asyncio.create_task(run(backend, first))
    await cluster.wait_for(lambda: _running(cluster, first))
    cluster.api.delete_object(JOBS, NS, _job(first), propagation="Orphan")
    assert (await old).lost
    second = await run(backend, launch(2, task_id))
    assert second.ok, second.error


async def test_a_deadline_after_the_container_ran_is_not_a_launch_failure(
    cluster: FakeCluster, backend: KubernetesBackend
) -> None:
    """The backstop activeDeadlineSeconds fires while the container runs (a long image pull
    ate into it): the Job controller deletes the pod and marks the Job Failed/DeadlineExceeded.
    The executor saw the container running, but the pod is gone when it judges: status.py calls
    it "deadline before the container started", a launch failure — the task goes back to Ready
    without spending a retry and runs again (up to max_launch_failures times)."""
    cluster.script = lambda job: RunUntilDeleted(log="working\n")
    what = launch(timeout_s=3600)
    running = asyncio.create_task(run(backend, what))
    await cluster.wait_for(lambda: _running(cluster, what))
    await asyncio.sleep(0.2)  # the executor has seen it running
    assert backend.followed[(what.task_id, what.attempt)].started is not None

    def deadline(job: dict[str, Any]) -> None:
        job["status"]["conditions"] = [
            {
                "type": "Failed",
                "status": "True",
                "reason": "DeadlineExceeded",
                "message": "Job was active longer than specified deadline",
            }
        ]
        job["status"].update(active=0, failed=1)

    cluster.api.mutate(JOBS, NS, _job(what), deadline)
    pod = cluster.pods_of(_job(what))[0]["metadata"]["name"]
    cluster.api.delete_object(PODS, NS, pod)
    outcome = await asyncio.wait_for(running, 10)
    assert not outcome.unstarted, f"it ran, yet: {outcome.error}"


async def test_the_log_tail_read_is_bounded_in_bytes(
    cluster: FakeCluster, backend: KubernetesBackend
) -> None:
    """A task writes long lines (a progress bar without newlines, a JSON dump): kube.pod_log
    asks for tailLines=2000 with no limitBytes, so the whole of those lines — here 16 MiB, in
    a real cluster gigabytes — is read into the executor's memory to keep the last 64 KiB, at
    every outcome, stop and loss-ladder rung."""
    big = "x" * (8 * 2**20) + "\n" + "y" * (8 * 2**20) + "\n"
    cluster.script = lambda job: Succeed(log=big)
    outcome = await run(backend, launch())
    assert outcome.ok
    asked = [r.params for r in cluster.api if r.subresource == "log" and r.method.name == "GET"]
    assert asked, "the log was read"
    assert all(int(p.get("limitBytes") or 0) for p in asked), asked


async def test_a_forged_job_with_skeds_labels_is_not_adopted(
    cluster: FakeCluster, backend: KubernetesBackend
) -> None:
    """Someone who may create Jobs in the namespace (another tenant, a CI job) creates
    `sked-<task>-<attempt>` first, copying sked's labels but with an image and command of
    their own. The create meets 409 and launch._adopt accepts it on its labels alone (no uid
    is recorded yet): sked records the stranger's uid and reports its exit as the task's."""
    what = launch()
    forged = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": _job(what),
            "namespace": NS,
            "labels": labels(what.task_id, what.attempt, "n1"),
        },
        "spec": {
            "template": {
                "metadata": {"labels": labels(what.task_id, what.attempt, "n1")},
                "spec": {
                    "restartPolicy": "Never",
                    "nodeSelector": {"kubernetes.io/hostname": "n1"},
                    "containers": [
                        {"name": "task", "image": "evil.example/miner:1", "command": ["mine"]}
                    ],
                },
            }
        },
    }
    cluster.script = lambda job: Succeed()
    await backend.kube.create_job(forged)
    outcome = await run(backend, what)
    adopted = [
        j["spec"]["template"]["spec"]["containers"][0]["image"]
        for j in cluster.jobs.values()
        if j["metadata"]["name"] == _job(what)
    ]
    assert not outcome.ok, f"the stranger's Job ({adopted}) was adopted as the task's"


def _k8s_expand(text: str, env: dict[str, str]) -> str:
    """What the kubelet does to a container's command, args and env values (the `expansion`
    package): `$$` is a literal `$`, `$(NAME)` of a defined variable is its value, any other
    `$(...)` is left as it is."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "$" and i + 1 < len(text):
            nxt = text[i + 1]
            if nxt == "$":
                out.append("$")
                i += 2
                continue
            if nxt == "(":
                end = text.find(")", i + 2)
                if end != -1:
                    name = text[i + 2 : end]
                    out.append(env[name] if name in env else text[i : end + 1])
                    i = end + 1
                    continue
        out.append(text[i])
        i += 1
    return "".join(out)


async def test_argv_reaches_the_container_as_written(
    cluster: FakeCluster, backend: KubernetesBackend
) -> None:
    """The spec's argv goes into the container's `command` unescaped; the kubelet expands
    `$(NAME)` there against the container's environment. `sh -c 'echo $(K)'` (a shell command
    substitution) runs as `sh -c 'echo v'`, and an argv can read SKED_HEARTBEAT_TOKEN into a
    place its author never put it: the command differs from what the local backend runs."""
    argv = ["sh", "-c", "echo $(K) $(SKED_HEARTBEAT_URL) costs $$5"]
    what = launch(argv=argv, env={"K": "v", "B": "$(K)"})
    cluster.script = lambda job: Succeed()
    assert (await run(backend, what)).ok
    job = next(j for j in cluster.created_jobs if j["metadata"]["name"] == _job(what))
    container = job["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"]}
    ran = [_k8s_expand(a, env) for a in container["command"]]
    assert ran == argv
    assert _k8s_expand(env["B"], {"K": "v"}) == "$(K)"


async def test_one_node_reporting_nonsense_does_not_break_every_launch(
    cluster: FakeCluster, backend: KubernetesBackend
) -> None:
    """A node reports allocatable memory "1e999" (a float that parses: infinity). manifest.
    quantity() promises nonsense "counts as 0", but int(inf // 2**20) raises in node_offer, so
    offers() raises for the whole cluster: every launch on every node fails (the launcher
    calls offers()), and the executor's node loop (serving.sync) dies on it."""
    cluster.add_node("weird", memory="1e999")
    await cluster.wait_for(lambda: "weird" in backend.nodes.objects)
    outcome = await run(backend, launch())  # on n1, a sane node
    assert outcome.ok, outcome.error


async def test_the_sweep_does_not_delete_jobs_of_tasks_it_does_not_know(
    cluster: FakeCluster, backend: KubernetesBackend, store: Any
) -> None:
    """Two sked installations (staging and production, or two teams) share a namespace. Their
    Jobs carry the same `app.kubernetes.io/managed-by=sked` label and nothing names the
    installation. Executor.discard_superseded treats a Job whose task id is not in *its*
    database as superseded and deletes it: each installation kills the other's running Jobs at
    every executor start and every 30 node heartbeats."""
    from types import SimpleNamespace

    from services.executor.service import Executor

    cluster.script = lambda job: RunUntilDeleted()
    theirs = launch()  # launched by the other installation's executor (its own database)
    body = job_manifest(
        theirs.task_id,
        1,
        "n1",
        "n1",
        theirs.job,
        Resources(),
        {},
        None,
        JobOptions(NS),  # type: ignore[arg-type]
    )
    await backend.kube.create_job(body)  # the same manifest their executor makes
    await cluster.wait_for(lambda: _running(cluster, theirs))
    await cluster.wait_for(lambda: (theirs.task_id, 1) in backend.adoptable())
    ours = SimpleNamespace(node=SimpleNamespace(backend=backend, active={}), store=store)
    await Executor.discard_superseded(ours)  # type: ignore[arg-type]
    await asyncio.sleep(0.3)
    left = sorted(cluster.jobs)
    assert _job(theirs) in left, "another installation's running Job was deleted"


async def test_a_timed_out_attempt_keeps_its_log_tail(
    cluster: FakeCluster, backend: KubernetesBackend
) -> None:
    """On sked's run timeout, _follow deletes the Job (Background) first and reads the log
    after: by then the pod is being collected, and the tail stored with the TimedOut outcome
    (what `sked logs` shows of an ended attempt) is empty. stop_task reads it before."""
    cluster.gc_delay_s = 0.0  # the pod exits at once on SIGTERM and is collected
    cluster.script = lambda job: RunUntilDeleted(log="step 41 of 100: still going\n")
    outcome = await run(backend, launch(timeout_s=0.5))
    assert outcome.timed_out
    assert "still going" in outcome.log_tail, repr(outcome.log_tail)


async def test_an_oom_killed_attempt_says_so(
    cluster: FakeCluster, backend: KubernetesBackend
) -> None:
    """The container is OOMKilled (terminated, exitCode 137, reason OOMKilled). status.py keeps
    the reason in the verdict, but _follow reports only "exit code 137": the attempt fails
    with no word of memory, the one thing its owner needs to fix."""
    cluster.script = lambda job: RunUntilDeleted(log="allocating\n")
    what = launch()
    running = asyncio.create_task(run(backend, what))
    await cluster.wait_for(lambda: _running(cluster, what))
    pod = cluster.pods_of(_job(what))[0]

    def oom(p: dict[str, Any]) -> None:
        p["status"]["phase"] = "Failed"
        status = p["status"]["containerStatuses"][0]
        started = status["state"]["running"]["startedAt"]
        status["state"] = {
            "terminated": {"exitCode": 137, "reason": "OOMKilled", "startedAt": started}
        }

    cluster.api.mutate(PODS, NS, pod["metadata"]["name"], oom)
    outcome = await asyncio.wait_for(running, 10)
    assert outcome.result == {"exit_code": 137}
    assert "OOMKilled" in (outcome.error or ""), outcome.error


async def test_a_pod_that_is_not_the_jobs_does_not_decide_the_outcome(
    cluster: FakeCluster, backend: KubernetesBackend
) -> None:
    """An operator debugs a task with `kubectl debug POD --copy-to=dbg --keep-labels`: the
    copy carries sked's labels but belongs to no Job. The backend picks an attempt's pod by
    labels alone (_pods_of / status.latest: the newest), never by its owner (the recorded Job's
    uid), so the debug copy's exit decides the attempt: reported succeeded while its real pod
    still runs."""
    cluster.script = lambda job: RunUntilDeleted(log="working\n")
    what = launch()
    running = asyncio.create_task(run(backend, what))
    await cluster.wait_for(lambda: _running(cluster, what))
    real = cluster.pods_of(_job(what))[0]
    await asyncio.sleep(1.1)  # creationTimestamp has a one-second grain
    copy_labels = {
        k: v for k, v in real["metadata"]["labels"].items() if not k.endswith("controller-uid")
    }
    debug_copy = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "dbg", "namespace": NS, "labels": copy_labels},
        "spec": {**real["spec"], "nodeName": "n1"},
        "status": {
            "phase": "Succeeded",
            "containerStatuses": [
                {"name": "task", "state": {"terminated": {"exitCode": 0, "reason": "Completed"}}}
            ],
        },
    }
    cluster.api.create(PODS, NS, debug_copy)
    await asyncio.sleep(1.0)
    reported = running.result() if running.done() else None
    running.cancel()
    assert reported is None, f"the real pod still runs, yet it was reported: {reported}"


async def test_a_key_reused_after_retention_does_not_adopt_the_old_tasks_job(
    cluster: FakeCluster, backend: KubernetesBackend
) -> None:
    """A keyed task's id is its key's, and once retention deleted the task the key is free
    (README): a submission with it makes a task of the same id, whose first attempt's Job has
    the old first attempt's name. With a Job TTL (SKED_K8S_JOB_TTL_S) longer than the
    retention, the old Job still stands; its record (table launches) went with the old task,
    so the create met 409 and `_adopt` took the old Job, made from the same spec, for this
    attempt's: the new task ended with the old run's outcome and never ran.

    Now each Job carries its task's incarnation (the row's created_at), and a Job of an
    earlier incarnation of the task is deleted, its pods awaited, and this one's created."""
    task_id = uuid.uuid4()
    old = Launch(**{**launch(task_id=task_id).__dict__, "incarnation": "2026-12-01 10:00:00+00"})
    cluster.script = lambda job: Succeed()
    assert (await run(backend, old)).ok
    backend.book.uids.clear()  # type: ignore[attr-defined]  # the old launches went with it
    new = Launch(**{**old.__dict__, "incarnation": "2026-12-06 10:00:00+00"})
    cluster.script = lambda job: Fail(3)
    outcome = await run(backend, new)
    assert not outcome.ok, "the new task ended with the old task's Job's outcome"
    assert outcome.result == {"exit_code": 3}


MAX_ARG_STRLEN = 32 * 4096  # Linux: the longest single argv/env string execve() takes


def _with_inputs(inputs: object) -> Launch:
    return Launch(**{**launch(argv=["sh", "-c", "cat"]).__dict__, "inputs": inputs})


async def test_inputs_over_the_kernel_s_env_string_limit_never_make_a_job_that_cannot_exec(
    cluster: FakeCluster, backend: KubernetesBackend
) -> None:
    """A workflow task's inputs (up to 8 MiB of JSON: dag.MAX_INPUTS_BYTES) reached a Job as ONE
    environment variable, SKED_INPUTS_JSON. Linux refuses any single env string longer than
    MAX_ARG_STRLEN (128 KiB) at execve with E2BIG, so with inputs over ~128 KiB sked created a
    Job whose container could never start ("exec: argument list too long", exit 128), reported
    an ordinary exit-code failure and spent every retry on a task that could never run.

    Now inputs go in the file $SKED_INPUTS (a Secret of the attempt's own), and the variable
    carries them only up to 64 KiB: such a task runs. A string of the task's own over the
    limit is still refused before any Job is made (manifest.check_exec_size), once and for
    good, naming the size and the limit. Shown first: this very kernel refuses such a string."""
    cluster.script = lambda job: Succeed()
    inputs = {"extract": "x" * (200 * 1024)}  # 200 KiB: well within sked's 8 MiB promise
    value = json.dumps(inputs)
    with pytest.raises(OSError, match="too long") as refused:
        subprocess.run(["true"], env={"SKED_INPUTS_JSON": value}, check=False, timeout=10)
    assert refused.value.errno == 7, refused.value  # E2BIG
    what = _with_inputs(inputs)
    outcome = await run(backend, what, timeout=20)
    assert outcome.ok, outcome
    (job,) = [j for j in cluster.created_jobs if j["metadata"]["name"] == _job(what)]
    env = {e["name"] for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert "SKED_INPUTS" in env
    assert "SKED_INPUTS_JSON" not in env
    own = launch(env={"BIG": value})
    outcome = await run(backend, own, timeout=20)
    assert cluster.create_attempts[_job(own)] == 0
    assert not outcome.ok, outcome
    assert outcome.final, outcome
    why = str(outcome.error)
    assert "BIG" in why, why
    assert str(MAX_ARG_STRLEN - 1) in why, why


async def test_a_command_and_environment_over_arg_max_fail_the_task_once(
    cluster: FakeCluster, backend: KubernetesBackend
) -> None:
    """Many env strings each under 128 KiB but together over ARG_MAX (2 MiB under the default
    stack limit) cannot exec either: refused up front too, permanently, naming the sizes."""
    cluster.script = lambda job: Succeed()
    many = {f"V{i}": "x" * (100 * 1024) for i in range(24)}  # 2.4 MiB
    what = launch(env=many)
    outcome = await run(backend, what, timeout=20)
    assert cluster.create_attempts[_job(what)] == 0
    assert not outcome.ok, outcome
    assert outcome.final, outcome
    assert "environment are" in str(outcome.error), outcome


async def test_a_job_refused_as_too_large_413_fails_at_once_saying_so(
    cluster: FakeCluster, backend: KubernetesBackend
) -> None:
    """Inputs of a few MiB (allowed by sked: 8 MiB) make a Job body the real API server refuses
    with 413 Request Entity Too Large (over its 3 MiB request limit). Launcher._create treated
    every status but 400/403/409/422 as transient: it sent the same multi-MiB body
    CREATE_TRIES (5) times with backoff, then reported a *non-final* launch failure, so the
    task went back to Ready without spending a retry and the cycle repeated
    max_launch_failures times before the task failed, with a reason that read like an outage.

    Now a 413 is permanent: one create, a final outcome whose reason names the body's size."""
    cluster.script = lambda job: Succeed()
    cluster.fail_next_create(status=413, stored=False, count=10)
    what = _with_inputs({"extract": "x" * 1024})
    outcome = await run(backend, what, timeout=30)
    tries = cluster.create_attempts[_job(what)]
    assert tries == 1, f"a 413 (too large: permanent) was sent {tries} times; outcome {outcome!r}"
    assert outcome.final, f"a Job too large to create is not final: {outcome!r}"
    assert "too large" in str(outcome.error), outcome
    assert "bytes" in str(outcome.error), outcome


async def test_a_job_etcd_refuses_as_too_large_fails_at_once(
    backend: KubernetesBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The API server passes etcd's refusal of an object over its --max-request-bytes (1.5 MiB
    by default) on as a 500 "etcdserver: request is too large", which was retried as an
    outage (see the 413 test). Now it is permanent; another 500 is still retried."""
    tries = 0
    message = {"kind": "Status", "code": 500, "message": "etcdserver: request is too large"}

    async def too_large(body: Any) -> Any:
        nonlocal tries
        tries += 1
        raise KubeError(500, json.dumps(message))

    monkeypatch.setattr(backend.kube, "create_job", too_large)
    outcome = await run(backend, _with_inputs({"extract": "x"}), timeout=30)
    assert tries == 1, outcome
    assert outcome.final, outcome
    assert "too large" in str(outcome.error), outcome
