"""What sked asks of Kubernetes, as wire dicts (pure): one Job per attempt, and the sked node a
cluster node becomes.

The Job is built so that Kubernetes never retries behind sked's back (sked owns retries):
`backoffLimit: 0`, `restartPolicy: Never`, and a pod failure policy that fails the Job on the
first failed or disrupted pod, keeping the cause in the Job's condition. The run timeout is
sked's, counted from the container's start; `activeDeadlineSeconds` is only a backstop (it
also counts the image pull).

A workflow task's data flow, as on the local backend: its inputs in the file `$SKED_INPUTS`
(a Secret of the attempt's own, mounted read-only: inputs may be far larger than a variable
holds), and its declared output the JSON it writes to `$SKED_OUTPUT`, which is the container's
termination message file: the kubelet hands at most 4096 bytes of it back in the pod's status,
the one channel out of a finished container that needs no credentials in it.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from services.executor.backends import NodeOffer
from shared.execlimits import check_exec_size
from shared.models import CommandJob, Resources
from shared.settings_model import NODE_ID_PATTERN

MANAGED_BY = "app.kubernetes.io/managed-by"
TASK_LABEL = "sked.io/task-id"
ATTEMPT_LABEL = "sked.io/attempt"
NODE_LABEL = "sked.io/node"
SELECTOR = f"{MANAGED_BY}=sked"  # every object sked creates
CONTAINER = "task"
DIGEST = "sked.io/spec-sha256"  # the annotation naming the spec a Job was made from
INCARNATION = "sked.io/task-created"  # and the one naming its task's incarnation (Launch)
GPU = "nvidia.com/gpu"
# A task's declared output: what it writes to this file, its termination message. A path of
# sked's own, not the default /dev/termination-log: a container that writes a message there for
# its own reasons declares nothing by it.
OUTPUT_PATH = "/dev/sked-output"
MAX_MESSAGE_BYTES = 4096  # the most of a termination message the kubelet keeps (its end)
# and what all of a pod's containers' messages share: each is cut to its part of this
# (the kubelet's normalizeStatus), 3072 bytes with four containers, say (a mesh's sidecars)
POD_MESSAGE_BYTES = 12 * 1024
INPUTS_VOLUME = "sked-inputs"
INPUTS_DIR = "/var/run/sked"
INPUTS_FILE = "inputs.json"
INPUTS_PATH = f"{INPUTS_DIR}/{INPUTS_FILE}"
MAX_SECRET_BYTES = 1024 * 1024  # what the API server takes in one Secret's data
HOSTNAME = "kubernetes.io/hostname"

# The backstop deadline allows this much for pulling the image and starting the container
# beyond the run timeout; sked's own timer (from the container's start) normally acts first.
BACKSTOP_EXTRA_S = 600

_INT32 = 2**31 - 1
_NODE_ID = re.compile(NODE_ID_PATTERN)  # what a sked node id may be


def job_name(task_id: UUID, attempt: int) -> str:
    """The Job of one attempt: the same name every time it is asked for (a retried create
    then meets its own Job). 5 + 36 + 1 + 10 characters at most: under Kubernetes' 63, with
    room for the pod's 6-character suffix."""
    return f"sked-{task_id}-{attempt}"


def labels(task_id: UUID, attempt: int, node: str) -> dict[str, str]:
    return {
        MANAGED_BY: "sked",
        TASK_LABEL: str(task_id),
        ATTEMPT_LABEL: str(attempt),
        NODE_LABEL: node,
    }


def key_of(obj: Mapping[str, Any]) -> tuple[UUID, int] | None:
    """(task id, attempt) from a Job's or pod's labels; None for anything not sked's."""
    found = (obj.get("metadata") or {}).get("labels") or {}
    try:
        return UUID(found[TASK_LABEL]), int(found[ATTEMPT_LABEL])
    except (KeyError, ValueError, TypeError):
        return None


@dataclass(frozen=True)
class JobOptions:
    """The deployment's part of every Job (settings)."""

    namespace: str
    ttl_s: int = 3600
    tolerations: Sequence[Mapping[str, Any]] = ()
    image_pull_secrets: Sequence[str] = ()


def _quantities(resources: Resources) -> tuple[dict[str, str], dict[str, str]]:
    requests: dict[str, str] = {}
    limits: dict[str, str] = {}
    if resources.cpu > 0:
        requests["cpu"] = limits["cpu"] = f"{round(resources.cpu * 1000)}m"
    if resources.memory_mb > 0:
        requests["memory"] = limits["memory"] = f"{resources.memory_mb}Mi"
    if resources.gpu > 0:
        limits[GPU] = str(resources.gpu)  # an extended resource: requests default to limits
    return requests, limits


def job_manifest(
    task_id: UUID,
    attempt: int,
    node: str,
    hostname: str,
    job: CommandJob,
    resources: Resources,
    env: Mapping[str, str],
    timeout_s: float | None,
    options: JobOptions,
    incarnation: str | None = None,
    inputs: bytes | None = None,
) -> dict[str, Any]:
    """The Job for one attempt of a command task, pinned to the cluster node sked placed it
    on (by its hostname label). `env`: the task's own environment plus sked's (heartbeat).
    `inputs` (a workflow task's, as JSON): the attempt's Secret (`inputs_secret`) is mounted
    and named by $SKED_INPUTS."""
    if not job.image:
        raise ValueError("the kubernetes backend needs job.image")
    env = {**job.env, **env, "SKED_OUTPUT": OUTPUT_PATH}
    if inputs is not None:
        env["SKED_INPUTS"] = INPUTS_PATH
    check_exec_size(job.argv, env)
    marks = labels(task_id, attempt, node)
    requests, limits = _quantities(resources)
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": job.image,
        # as written: the kubelet expands $(NAME) in both and reads $$ as $
        "command": [_literal(a) for a in job.argv],
        "env": [{"name": k, "value": _literal(v)} for k, v in env.items()],
        "resources": {"requests": requests, "limits": limits},
        "terminationMessagePath": OUTPUT_PATH,
        # the end of the log stands in for the termination message when a failed task wrote
        # none (a success's is its declared output, or nothing)
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": {"allowPrivilegeEscalation": False},
    }
    if job.cwd:
        container["workingDir"] = job.cwd
    pod: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,  # a task gets no credentials of the cluster
        "enableServiceLinks": False,
        "nodeSelector": {HOSTNAME: hostname},
        "containers": [container],
    }
    if inputs is not None:
        container["volumeMounts"] = [
            {"name": INPUTS_VOLUME, "mountPath": INPUTS_DIR, "readOnly": True}
        ]
        # The kubelet starts the container only once the Secret exists (it is made just after
        # the Job, owned by it) AND holds this key, named by the inputs' hash: a Secret of the
        # name left by anyone else (a stranger, an earlier task of a reused key) cannot be
        # mounted in its place, however the creates and deletes interleave.
        secret = {
            "secretName": job_name(task_id, attempt),
            "items": [{"key": inputs_key(inputs), "path": INPUTS_FILE}],
            "defaultMode": 0o444,
        }
        pod["volumes"] = [{"name": INPUTS_VOLUME, "secret": secret}]
    if options.tolerations:
        pod["tolerations"] = [dict(t) for t in options.tolerations]
    if options.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": n} for n in options.image_pull_secrets]
    spec: dict[str, Any] = {
        "backoffLimit": 0,
        # no replacement pod, whatever ended the first: the cause stays in the Job's condition
        "podFailurePolicy": {
            "rules": [
                {
                    "action": "FailJob",
                    "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
                },
                {
                    "action": "FailJob",
                    "onExitCodes": {"containerName": CONTAINER, "operator": "NotIn", "values": [0]},
                },
            ]
        },
        "ttlSecondsAfterFinished": options.ttl_s,
        "template": {"metadata": {"labels": marks}, "spec": pod},
    }
    if timeout_s is not None:
        spec["activeDeadlineSeconds"] = int(timeout_s) + 1 + BACKSTOP_EXTRA_S
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": job_name(task_id, attempt),
            "namespace": options.namespace,
            "labels": marks,
            # what this spec is: a Job met by name (409) is this attempt's only if it says so
            # (its spec holds the attempt's heartbeat token, which no stranger can make)
            "annotations": {DIGEST: spec_digest(spec)}
            | ({INCARNATION: incarnation} if incarnation else {}),
        },
        "spec": spec,
    }


def inputs_secret(job: Mapping[str, Any], data: bytes) -> dict[str, Any]:
    """The Secret holding an attempt's inputs (`data`, JSON), named as its Job and owned by it:
    the garbage collector deletes it with the Job. Immutable: the kubelet need not watch it.
    At most MAX_SECRET_BYTES of `data` (the launcher checks before it makes the Job)."""
    meta = job["metadata"]
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "immutable": True,
        "metadata": {
            "name": meta["name"],
            "namespace": meta["namespace"],
            "labels": dict(meta.get("labels") or {}),
            "ownerReferences": [
                {"apiVersion": "batch/v1", "kind": "Job", "name": meta["name"], "uid": meta["uid"]}
            ],
        },
        "data": {inputs_key(data): base64.b64encode(data).decode("ascii")},
    }


def inputs_key(data: bytes) -> str:
    return f"inputs-{hashlib.sha256(data).hexdigest()}.json"


def message_cap(pod: Mapping[str, Any] | None) -> int:
    """The most of a termination message that reaches the pod's status whole: 4096 bytes, or
    less when many containers share the pod's 12 KiB (counted from the pod's spec, sidecars a
    webhook added included). A message this long or longer may have been cut."""
    spec = (pod or {}).get("spec") or {}
    kinds = ("containers", "initContainers", "ephemeralContainers")
    # an API object is read as hostile: a list where one is expected, else nothing counted
    containers = sum(len(got) for kind in kinds if isinstance(got := spec.get(kind), list))
    return min(MAX_MESSAGE_BYTES, POD_MESSAGE_BYTES // max(1, containers))


def declared_output(message: str | None, cap: int = MAX_MESSAGE_BYTES) -> tuple[bytes, str | None]:
    """A successful container's declared output, from its termination message: (the bytes,
    None), or (b"", why it cannot be taken). A message of `cap` bytes or more (`message_cap`)
    may have been cut by the kubelet, so it is refused rather than read as what the task
    wrote. A lone surrogate (not from a kubelet, which sends UTF-8) is kept, for the parse to
    refuse."""
    data = (message or "").encode("utf-8", "surrogatepass")
    if len(data) >= cap:
        shared = "" if cap == MAX_MESSAGE_BYTES else ", less with its pod's other containers"
        return b"", (
            f"declared output of {cap} bytes or more in $SKED_OUTPUT: on Kubernetes it is the "
            f"termination message, of which the kubelet keeps at most {cap} bytes{shared}"
        )
    return data, None


def spec_digest(spec: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def _literal(text: str) -> str:
    return text.replace("$", "$$")


# -- cluster nodes as sked nodes ---------------------------------------------------------------


_SUFFIX = {
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
}


def quantity(text: object) -> float:
    """A Kubernetes quantity ('3800m', '16Gi', '2', '1e3') as a number (cpu in cores, memory
    in bytes). A value that is not a quantity counts as 0: a node that reports nonsense
    offers nothing rather than stopping the executor."""
    value = str(text or "").strip()
    scale, per = 1, 1
    if value.endswith("m"):
        value, per = value[:-1], 1000
    else:
        for suffix in sorted(_SUFFIX, key=len, reverse=True):
            if value.endswith(suffix):
                value, scale = value[: -len(suffix)], _SUFFIX[suffix]
                break
    try:
        number = float(value) * scale / per
    except (ValueError, OverflowError):
        return 0.0
    # infinity ("1e999"), NaN or a negative is nonsense too: int() of it would raise
    return number if math.isfinite(number) and number >= 0 else 0.0


def node_ready(node: Mapping[str, Any]) -> bool:
    """Its Ready condition is True (cordoned or not: a cordoned node still runs its pods)."""
    conditions = (node.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def node_offer(node: Mapping[str, Any]) -> NodeOffer | None:
    """What a cluster node offers, from its API object: allocatable cpu, memory and GPUs, its
    labels; ready only when its Ready condition is True and it is not cordoned. None for a
    node whose name cannot be a sked node id."""
    meta = node.get("metadata") or {}
    name = str(meta.get("name") or "")
    if not _NODE_ID.match(name):
        return None
    status = node.get("status") or {}
    free = status.get("allocatable") or {}
    cordoned = bool((node.get("spec") or {}).get("unschedulable"))
    node_labels = {str(k): str(v) for k, v in (meta.get("labels") or {}).items()}
    # each within its column (a node reporting 1e300 pods must not fail its row's write)
    return NodeOffer(
        id=name,
        slots=min(max(1, int(quantity(free.get("pods", "110")))), _INT32),
        cpu=min(quantity(free.get("cpu")), 1e9),
        memory_mb=min(int(quantity(free.get("memory")) // 2**20), 2**63 - 1),
        gpu=min(int(quantity(free.get(GPU))), _INT32),
        labels=node_labels,
        ready=node_ready(node) and not cordoned,
        hostname=node_labels.get(HOSTNAME, name),
    )
