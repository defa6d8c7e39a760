"""The Kubernetes backend's pure parts: the Job of an attempt, cluster nodes as sked nodes, and
how an attempt stands judged from its Job and pods."""

from __future__ import annotations

import base64
import hashlib
import re
import uuid
from typing import Any

import kubernetes_validate
import pytest

from services.cli import build_parser
from services.cli.commands import spec_from_args
from services.executor.backends.kubernetes.manifest import (
    GPU,
    JobOptions,
    declared_output,
    inputs_secret,
    job_manifest,
    job_name,
    key_of,
    message_cap,
    node_offer,
    quantity,
)
from services.executor.backends.kubernetes.status import exited, judge
from shared.dag import WorkflowTask
from shared.errors import InvalidSpec, SkedError
from shared.models import CommandJob, Resources

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
TASK = uuid.UUID("6f1c2b1e-5a8e-4f55-9a43-2b8a3f4c9d10")
OPTIONS = JobOptions(
    namespace="sked-jobs",
    ttl_s=600,
    tolerations=[{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
    image_pull_secrets=["registry"],
)


def manifest(**kw: Any) -> dict[str, Any]:
    args: dict[str, Any] = {
        "task_id": TASK,
        "attempt": 3,
        "node": "gpu-1",
        "hostname": "gpu-1.example",
        "job": CommandJob(argv=["python", "-c", "print(1)"], image="python:3.12", env={"A": "1"}),
        "resources": Resources(cpu=1.5, memory_mb=512, gpu=2),
        "env": {"SKED_HEARTBEAT_URL": "http://monitor:8470/heartbeat"},
        "timeout_s": 60.0,
        "options": OPTIONS,
    }
    return job_manifest(**{**args, **kw})


def test_the_job_name_is_fixed_by_task_and_attempt_and_fits_kubernetes() -> None:
    name = job_name(TASK, 2**31 - 1)
    assert name == job_name(TASK, 2**31 - 1)
    assert len(name) <= 63 - 6  # its pods add a 6-character suffix
    assert DNS_LABEL.match(name)
    assert job_name(TASK, 1) != job_name(TASK, 2)


@pytest.mark.parametrize("version", ["1.30", "1.34"])
def test_the_job_validates_against_kubernetes_schemas(version: str) -> None:
    kubernetes_validate.validate(manifest(), version, strict=True)
    kubernetes_validate.validate(manifest(timeout_s=None, options=JobOptions("x")), version, True)
    job = manifest(inputs=b'{"a": 1}')
    kubernetes_validate.validate(job, version, strict=True)
    created = {**job, "metadata": {**job["metadata"], "uid": str(uuid.uuid4())}}
    kubernetes_validate.validate(inputs_secret(created, b'{"a": 1}'), version, strict=True)


def test_a_workflow_task_reads_its_inputs_from_its_own_secret() -> None:
    job = manifest(inputs=b'{"up": [1]}')
    pod = job["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["SKED_INPUTS"] == "/var/run/sked/inputs.json"
    assert container["volumeMounts"] == [
        {"name": "sked-inputs", "mountPath": "/var/run/sked", "readOnly": True}
    ]
    # mounted only from a Secret holding these very inputs: a key named by their hash
    key = "inputs-" + hashlib.sha256(b'{"up": [1]}').hexdigest() + ".json"
    items = [{"key": key, "path": "inputs.json"}]
    assert pod["volumes"] == [
        {
            "name": "sked-inputs",
            "secret": {"secretName": job_name(TASK, 3), "items": items, "defaultMode": 0o444},
        }
    ]
    uid = str(uuid.uuid4())
    secret = inputs_secret({**job, "metadata": {**job["metadata"], "uid": uid}}, b'{"up": [1]}')
    assert secret["metadata"]["name"] == job_name(TASK, 3)
    assert secret["metadata"]["namespace"] == "sked-jobs"
    assert key_of(secret) == (TASK, 3)  # labelled as its Job
    assert secret["metadata"]["ownerReferences"] == [
        {"apiVersion": "batch/v1", "kind": "Job", "name": job_name(TASK, 3), "uid": uid}
    ]
    assert secret["immutable"] is True
    assert base64.b64decode(secret["data"][key]) == b'{"up": [1]}'
    assert manifest(inputs=b"{}")["spec"] != job["spec"]  # other inputs, another key


@pytest.mark.parametrize(
    ("message", "data", "refused"),
    [
        ("", b"", False),
        ('{"rows": 3}', b'{"rows": 3}', False),
        ("x" * 4095, b"x" * 4095, False),
        ("x" * 4096, b"", True),  # perhaps cut by the kubelet: not taken as what was written
        ("é" * 2048, b"", True),  # bytes, not characters
    ],
)
def test_a_declared_output_is_taken_from_the_termination_message_whole_or_not_at_all(
    message: str, data: bytes, refused: bool
) -> None:
    got, why = declared_output(message)
    assert got == data
    assert (why is not None) == refused
    if why is not None:
        assert "4096" in why
        assert "$SKED_OUTPUT" in why


def test_kubernetes_never_retries_behind_skeds_back() -> None:
    spec = manifest()["spec"]
    pod = spec["template"]["spec"]
    assert spec["backoffLimit"] == 0
    assert pod["restartPolicy"] == "Never"
    rules = spec["podFailurePolicy"]["rules"]
    assert {"type": "DisruptionTarget", "status": "True"} in rules[0]["onPodConditions"]
    assert rules[1]["onExitCodes"] == {"containerName": "task", "operator": "NotIn", "values": [0]}
    assert all(r["action"] == "FailJob" for r in rules)
    # the run timeout is sked's; the deadline only backs it up, with room for the image pull
    assert spec["activeDeadlineSeconds"] > 60
    assert spec["ttlSecondsAfterFinished"] == 600
    assert "activeDeadlineSeconds" not in manifest(timeout_s=None)["spec"]


def test_a_message_is_whole_only_under_the_pods_share_of_the_kubelets_budget() -> None:
    def pod_of(containers: int, init: int = 0) -> dict[str, Any]:
        spec = {"containers": [{}] * containers, "initContainers": [{}] * init}
        return {"spec": spec}

    assert message_cap(pod_of(1)) == 4096
    assert message_cap(pod_of(3)) == 4096  # 12 KiB / 3
    assert message_cap(pod_of(3, 1)) == 3072  # a mesh's sidecar and its init, and one more
    assert message_cap(None) == 4096
    assert message_cap({"spec": {"containers": 3, "initContainers": {"x": 1}}}) == 4096
    assert declared_output("7" * 3071, 3072) == (b"7" * 3071, None)
    data, why = declared_output("7" * 3072, 3072)
    assert data == b""
    assert "3072 bytes" in str(why)
    assert "other containers" in str(why)


def test_the_job_is_pinned_labelled_and_given_what_the_task_asked_for() -> None:
    job = manifest()
    pod = job["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert pod["nodeSelector"] == {"kubernetes.io/hostname": "gpu-1.example"}
    assert pod["automountServiceAccountToken"] is False
    assert pod["tolerations"] == list(OPTIONS.tolerations)
    assert pod["imagePullSecrets"] == [{"name": "registry"}]
    assert container["image"] == "python:3.12"
    assert container["command"] == ["python", "-c", "print(1)"]
    assert {e["name"]: e["value"] for e in container["env"]} == {
        "A": "1",
        "SKED_HEARTBEAT_URL": "http://monitor:8470/heartbeat",
        "SKED_OUTPUT": "/dev/sked-output",  # its termination message: the declared output
    }
    assert container["terminationMessagePath"] == "/dev/sked-output"
    assert "volumes" not in pod  # no inputs: no Secret
    assert "volumeMounts" not in container
    assert container["resources"] == {
        "requests": {"cpu": "1500m", "memory": "512Mi"},
        "limits": {"cpu": "1500m", "memory": "512Mi", GPU: "2"},
    }
    for labels in (job["metadata"]["labels"], job["spec"]["template"]["metadata"]["labels"]):
        assert key_of({"metadata": {"labels": labels}}) == (TASK, 3)
        assert all(LABEL_VALUE.match(v) and len(v) <= 63 for v in labels.values())
    assert job["metadata"]["namespace"] == "sked-jobs"


def test_a_job_without_an_image_is_refused() -> None:
    with pytest.raises(ValueError, match=r"job\.image"):
        manifest(job=CommandJob(argv=["true"]))


def test_objects_that_are_not_skeds_have_no_key() -> None:
    assert (
        key_of({"metadata": {"labels": {"sked.io/task-id": "nope", "sked.io/attempt": "1"}}})
        is None
    )
    assert key_of({}) is None


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("3800m", 3.8),
        ("16Gi", 16 * 2**30),
        ("2", 2),
        ("1e3", 1000),
        ("500M", 5e8),
        ("", 0),
        ("x", 0),
    ],
)
def test_quantities(text: str, value: float) -> None:
    assert quantity(text) == pytest.approx(value)


def node(
    name: str = "n1", ready: str = "True", cordoned: bool = False, **free: str
) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": f"{name}.h", "zone": "a"}},
        "spec": {"unschedulable": cordoned},
        "status": {
            "allocatable": {"cpu": "3800m", "memory": "16Gi", "pods": "110", **free},
            "conditions": [{"type": "Ready", "status": ready}],
        },
    }


def test_a_cluster_node_becomes_a_sked_node() -> None:
    offer = node_offer(node(**{GPU: "4"}))
    assert offer is not None
    assert (offer.id, offer.slots, offer.cpu, offer.memory_mb, offer.gpu) == (
        "n1",
        110,
        3.8,
        16384,
        4,
    )
    assert offer.ready
    assert offer.hostname == "n1.h"
    assert offer.labels["zone"] == "a"
    assert node_offer(node(ready="False")).ready is False  # type: ignore[union-attr]
    assert node_offer(node(ready="Unknown")).ready is False  # type: ignore[union-attr]
    assert node_offer(node(cordoned=True)).ready is False  # type: ignore[union-attr]
    assert node_offer(node(name="x" * 64)) is None  # cannot be a sked node id


# -- judging an attempt -----------------------------------------------------------------------

JOB: dict[str, Any] = {"metadata": {"name": "j"}, "status": {}}


def pod(state: dict[str, Any], *conditions: dict[str, Any], **status: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": "j-abcde", "creationTimestamp": "2026-01-01T00:00:00Z"},
        "status": {
            "containerStatuses": [{"name": "task", "state": state}],
            "conditions": list(conditions),
            **status,
        },
    }


def failed_job(reason: str) -> dict[str, Any]:
    return {
        "metadata": {"name": "j"},
        "status": {
            "conditions": [{"type": "Failed", "status": "True", "reason": reason, "message": "m"}]
        },
    }


def test_judging_exits_and_runs() -> None:
    assert judge(JOB, [pod({"running": {"startedAt": "t"}})], 0, 10).kind == "running"
    done = judge(JOB, [pod({"terminated": {"exitCode": 3, "reason": "Error"}})], 0, 10)
    assert (done.kind, done.exit_code) == ("exited", 3)
    assert judge(JOB, [], 0, 10).kind == "pending"


def test_an_exit_0_hands_on_its_termination_message_as_its_declared_output() -> None:
    key = (TASK, 1)

    def exit_with(code: int, message: str | None = None) -> Any:
        ended: dict[str, Any] = {"exitCode": code, "reason": "Completed" if code == 0 else "Error"}
        if message is not None:
            ended["message"] = message
        return exited(judge(JOB, [pod({"terminated": ended})], 0, 10), "log", key)

    declared = exit_with(0, '{"rows": [1, 2]}')
    assert (declared.ok, declared.result) == (True, {"exit_code": 0, "output": {"rows": [1, 2]}})
    assert exit_with(0).result == {"exit_code": 0}  # wrote nothing: declared nothing
    not_json = exit_with(0, "all good\n")
    assert not not_json.ok
    assert not_json.error is not None
    assert "not JSON" in not_json.error
    assert "termination message" in not_json.error
    nan = exit_with(0, '{"x": NaN}')
    assert not nan.ok
    assert "NaN" in (nan.error or "")
    cut = exit_with(0, "[" + "1," * 3000 + "1]")
    assert not cut.ok
    assert "4096" in (cut.error or "")
    # a failure's message is the log's end (FallbackToLogsOnError), never an output
    failed = exit_with(3, '{"rows": 1}')
    assert (failed.ok, failed.result) == (False, {"exit_code": 3})
    assert (failed.error or "").startswith("exit code 3")
    # a Job Complete whose pod is gone: the exit is known, any output is not
    gone = exited(
        judge(
            {**JOB, "status": {"conditions": [{"type": "Complete", "status": "True"}]}}, [], 0, 10
        ),
        "",
        key,
    )
    assert (gone.ok, gone.result) == (True, {"exit_code": 0})


def test_judging_losses() -> None:
    assert judge(None, [], 0, 10).kind == "lost"
    evicted = pod(
        {"terminated": {"exitCode": 137}},
        {"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"},
    )
    lost = judge(JOB, [evicted], 0, 10)
    assert lost.kind == "lost"
    assert "EvictionByEvictionAPI" in lost.reason
    assert judge(failed_job("PodFailurePolicy"), [], 0, 10).kind == "lost"


def test_judging_launch_failures() -> None:
    backoff = pod({"waiting": {"reason": "ImagePullBackOff", "message": "Back-off pulling image"}})
    assert judge(JOB, [backoff], 5, 10).kind == "pending"  # within its start budget
    late = judge(JOB, [backoff], 11, 10)
    assert (late.kind, late.permanent) == ("launch_failed", False)
    assert "ImagePullBackOff" in late.reason
    missing = pod({"waiting": {"reason": "ErrImagePull", "message": "manifest unknown"}})
    now = judge(JOB, [missing], 0, 10)
    assert (now.kind, now.permanent) == ("launch_failed", True)
    stuck = {
        "metadata": {"name": "j-x"},
        "status": {
            "phase": "Pending",
            "conditions": [
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": "0/3 nodes are available",
                }
            ],
        },
    }
    unschedulable = judge(JOB, [stuck], 11, 10)
    assert unschedulable.kind == "launch_failed"
    assert "Unschedulable" in unschedulable.reason
    assert judge(failed_job("DeadlineExceeded"), [], 0, 10).kind == "launch_failed"
    assert "no pod" in judge(JOB, [], 11, 10).reason


def test_sked_submit_takes_an_image_for_a_command_only() -> None:
    args = build_parser().parse_args(["submit", "--command", "run.sh", "--image", "app:2"])
    assert spec_from_args(args).job == CommandJob(argv=["run.sh"], image="app:2")
    args = build_parser().parse_args(["submit", "--handler", "m:f", "--image", "app:2"])
    with pytest.raises(SkedError, match="--image goes with --command"):
        spec_from_args(args)


def test_a_workflow_task_names_its_image_beside_its_command() -> None:
    spec = WorkflowTask.model_validate({"name": "t", "command": ["run"], "image": "app:3"}).spec()
    assert spec.job == CommandJob(argv=["run"], image="app:3")
    with pytest.raises(InvalidSpec, match="image goes with command"):
        WorkflowTask.model_validate({"name": "t", "handler": "m:f", "image": "app:3"}).spec()


def test_a_node_reporting_nonsense_offers_nothing_of_it() -> None:
    """Infinity, NaN, a negative or a number past a column: each counts as 0 or the most the
    column holds, never an exception that would stop every launch on the cluster."""
    offer = node_offer(node(memory="1e999", cpu="-3", pods="1e300", **{GPU: "nan"}))
    assert offer is not None
    assert (offer.memory_mb, offer.cpu, offer.slots, offer.gpu) == (0, 0.0, 2**31 - 1, 0)
