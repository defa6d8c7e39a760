"""A fake Kubernetes cluster for tests: an API server over real HTTP (`FakeKubeAPI`) and a driver
(`FakeCluster`) that plays the Job controller, the scheduler, the kubelets and the garbage
collector, so that the Kubernetes backend runs against a real `kubernetes_asyncio` client.

Hand-written on top of kmock because kmock is only a stateful API emulator: it has no controllers
(nothing creates a Job's pod, moves it or deletes dependents), fills in no uid or resourceVersion,
serves kubernetes-asyncio's `?watch=True` as a list, filters nothing by selector, and its direct
writes to `kmock.objects` emit no watch events. Here every write, the driver's included, goes
through one path that stamps a resourceVersion and emits the watch event.

Usage (no node exists until a test adds one; pods without a fitting node stay Pending):

    async with fake_cluster() as cluster:  # or the `fake_kube` fixture
        cluster.add_node("node-1", gpu=1)
        cluster.script = lambda job: Fail(exit_code=3) if job["spec"].get("x") else Succeed()
        async with client.ApiClient(cluster.configuration()) as api:
            await client.BatchV1Api(api).create_namespaced_job("ns", body)
        await cluster.wait_for(lambda: cluster.jobs["x"]["status"].get("succeeded"))

Covered
  API: create (uid, monotonic resourceVersion, namespace, creationTimestamp, generation,
  generateName; a Job's defaults, selector and controller labels; 422 on invalid names, label
  values, a Job's restartPolicy and containers; 500 when resourceVersion is set; dryRun), get,
  list and watch with labelSelector (=, ==, !=, in, notin, key, !key) and fieldSelector (dotted
  paths, =, ==, !=); watch from a resourceVersion replays what came after it, without one it
  starts with synthetic ADDED events; an object that stops (starts) matching a selector is sent
  as DELETED (ADDED); timeoutSeconds; merge, strategic-merge (lists merged by `type`/`name`) and
  JSON patch; PUT; status changes only through `/status`; 409 on a duplicate create, a stale
  resourceVersion or a failed delete precondition; 404; delete with propagationPolicy (a Job
  orphans its pods by default, as the real API does); finalizers; `pods/log` as text/plain.
  Secrets (v1/secrets) through the same write path: `data` values must be base64 (else 400, as
  from decoding), `stringData` is merged over `data` and dropped, `type` defaults to Opaque,
  keys must be config keys, the decoded data at most 1 MiB (422 "data: Too long: must have at
  most 1048576 bytes"); on update the type cannot change, nor an immutable Secret's data or its
  immutability (422 "data: Forbidden: field is immutable when `immutable` is set"). Several
  field errors come as the API server aggregates them: `is invalid: [a, b]`.
  Faults: a create stored and then answered 500 (or refused before storing), 410 Gone ERROR
  events for the next watches or for watches from before `compact()`, open watches ended cleanly
  or by closing their connections.
  Driver: nodes (allocatable, Ready, cordon, taints); one pod per Job placed by nodeSelector
  (the `kubernetes.io/hostname` hint included), readiness, cordon and `nvidia.com/gpu`, retried
  while it does not fit; pod and Job status walked through a scripted `Scenario`;
  activeDeadlineSeconds; ttlSecondsAfterFinished; podFailurePolicy FailJob rules decide the
  Failed reason; Complete/Failed only after the pod terminated; a deleted Job's pods are
  garbage-collected (Background and Foreground), its Secrets too (any object whose
  ownerReferences name it); a pod deleted under a running Job fails it.
  Kubelet: a container whose pod mounts a `secret` volume stays waiting, ContainerCreating (pod
  Pending), until that Secret exists in the pod's namespace (and the keys its `items` name),
  woken by the Secret's event; `optional: true` mounts nothing instead. On start it records the
  files it sees, {f"{mountPath}/{path}": text} (`items`, `subPath` honoured): `files(pod)`. The
  terminated state's `message` follows the kubelet: the END of what the container wrote to its
  terminationMessagePath (`Succeed`/`Fail(message=...)`, a text or a function of those files),
  at most 4096 bytes; if empty, with FallbackToLogsOnError and a non-zero exit code (Fail,
  deadline, eviction), the last 80 lines of the log, then of those the last 2048 bytes; else no
  `message`. A character cut by a byte limit becomes U+FFFD, as Go's JSON encoder sends it.

Not covered
  Authentication, RBAC, admission, quotas, events, full schema validation (use
  kubernetes_validate), pagination (limit/continue are ignored: one page holds everything),
  bookmarks, server-side apply, strategic-merge directives, graceful pod deletion (a deleted pod
  vanishes at once), the Job controller's retries (one pod per Job, as with backoffLimit 0;
  Ignore/Count rules are not honoured), parallelism and indexed Jobs, resource accounting across
  pods (a node fits a pod when its allocatable GPUs cover the pod's), tolerations and affinity,
  following logs, eviction and binding subresources, suspended Jobs. Secrets: the rules of
  types other than Opaque (required keys of kubernetes.io/tls, ...), mounted Secrets updated
  after the start, file modes (defaultMode, items' mode), FailedMount events, a Secret deleted
  as its pod starts; other volume kinds (configMap, projected, emptyDir) mount nothing and
  block nothing. A dependent created after its owner went (the real garbage collector deletes
  it on finding the owner absent) stays. The termination message: the pod-wide 12 KiB budget
  across containers (one container runs), a read error of the message file.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import bisect
import contextlib
import copy
import random
import re
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar
from uuid import uuid4

import aiohttp.web
import attrs
import jsonpatch  # a dependency of kmock; kmock.dicts uses it for the same purpose
import kmock
import pytest_asyncio
from kubernetes_asyncio import client

Obj = dict[str, Any]
T = TypeVar("T")

JOBS = kmock.resource("batch/v1/jobs")
PODS = kmock.resource("v1/pods")
NODES = kmock.resource("v1/nodes")
SECRETS = kmock.resource("v1/secrets")
_WITH_STATUS = (JOBS, PODS, NODES)  # their status changes only through /status
_KINDS = {
    "jobs": "Job",
    "pods": "Pod",
    "nodes": "Node",
    "namespaces": "Namespace",
    "secrets": "Secret",
}
_JOB_LABELS = ("batch.kubernetes.io/controller-uid", "batch.kubernetes.io/job-name")

_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_LABEL_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?")
_SUFFIX_CHARS = "bcdfghjklmnpqrstvwxz2456789"  # what the API server's name generator uses
_CONFIG_KEY = re.compile(r"[-._a-zA-Z0-9]+")
_BASE64 = re.compile(r"[A-Za-z0-9+/]*={0,2}")
MAX_SECRET_BYTES = 1024 * 1024  # core.MaxSecretSize: the decoded data of one Secret
MAX_REQUEST_BYTES = 3 * 1024 * 1024  # the API server's MaxRequestBodyBytes
# The kubelet (pkg/kubelet/container/runtime.go, kuberuntime_container.go): the END of the
# termination message file, at most 4096 bytes; failing that, with FallbackToLogsOnError and a
# non-zero exit code, the last 80 lines of the log, of which the last 2048 bytes.
MAX_MESSAGE_BYTES = 4096
MAX_LOG_MESSAGE_LINES = 80
MAX_LOG_MESSAGE_BYTES = 2048


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _suffix() -> str:
    return "".join(random.choices(_SUFFIX_CHARS, k=5))


def _res(resource: str | kmock.resource) -> kmock.resource:
    return resource if isinstance(resource, kmock.resource) else kmock.resource(resource)


def _kind(res: kmock.resource) -> str:
    plural = res.plural or ""
    return _KINDS.get(plural, plural.removesuffix("s").capitalize())


def _api_version(res: kmock.resource) -> str:
    return f"{res.group}/{res.version}" if res.group else str(res.version)


def _qualified(res: kmock.resource) -> str:
    return f"{res.plural}.{res.group}" if res.group else str(res.plural)


def _error(
    code: int, reason: str, message: str, res: kmock.resource | None = None, name: str = ""
) -> kmock.KubernetesError:
    """An error kmock renders as a Status body, shaped like the real API server's."""
    details = {"name": name, "group": res.group if res else "", "kind": res.plural if res else ""}
    return kmock.KubernetesError(status=code, reason=reason, message=message, details=details)


def _not_found(res: kmock.resource, name: str) -> kmock.KubernetesError:
    return _error(404, "NotFound", f'{_qualified(res)} "{name}" not found', res, name)


def _conflict(res: kmock.resource, name: str, why: str) -> kmock.KubernetesError:
    message = f'Operation cannot be fulfilled on {_qualified(res)} "{name}": {why}'
    return _error(409, "Conflict", message, res, name)


def _gone(since: str, now: int) -> Obj:
    status = {"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure"}
    message = f"too old resource version: {since} ({now})"
    return {
        "type": "ERROR",
        "object": {**status, "message": message, "reason": "Expired", "code": 410},
    }


def _merge(base: Any, patch: Any, strategic: bool) -> Any:
    """RFC 7386 merge patch; with `strategic`, lists of dicts are merged by `type` or `name`."""
    if isinstance(patch, list) and isinstance(base, list) and strategic:
        return _merge_list(base, patch)
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(base) if isinstance(base, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = _merge(out.get(key), value, strategic)
    return out


def _merge_list(base: list[Any], patch: list[Any]) -> list[Any]:
    items = [*base, *patch]
    key = next(
        (k for k in ("type", "name") if all(isinstance(i, dict) and k in i for i in items)), None
    )
    if key is None:
        return copy.deepcopy(patch)
    out = copy.deepcopy(base)
    for item in patch:
        at = next((n for n, old in enumerate(out) if old[key] == item[key]), None)
        if at is None:
            out.append(copy.deepcopy(item))
        else:
            out[at] = _merge(out[at], item, True)
    return out


def _terms(selector: str) -> list[str]:
    return [t.strip() for t in re.split(r",(?![^()]*\))", selector or "") if t.strip()]


@dataclass(frozen=True)
class Selector:
    """A parsed labelSelector and fieldSelector, as the API server applies them."""

    labels: tuple[tuple[str, str, frozenset[str]], ...] = ()
    fields: tuple[tuple[str, str, str], ...] = ()

    @classmethod
    def parse(cls, label_selector: str = "", field_selector: str = "") -> Selector:
        labels: list[tuple[str, str, frozenset[str]]] = []
        for term in _terms(label_selector):
            if m := re.fullmatch(r"(\S+)\s+(in|notin)\s+\((.*)\)", term):
                labels.append((m[1], m[2], frozenset(v.strip() for v in m[3].split(","))))
            elif m := re.fullmatch(r"([^!=\s]+)\s*(==|=|!=)\s*(\S*)", term):
                labels.append((m[1], "!=" if m[2] == "!=" else "=", frozenset({m[3]})))
            elif term.startswith("!"):
                labels.append((term[1:].strip(), "!", frozenset()))
            else:
                labels.append((term, "exists", frozenset()))
        fields: list[tuple[str, str, str]] = []
        for term in _terms(field_selector):
            if not (m := re.fullmatch(r"([^!=\s]+)\s*(==|=|!=)\s*(\S*)", term)):
                raise _error(400, "BadRequest", f'invalid field selector: "{term}"')
            fields.append((m[1], "!=" if m[2] == "!=" else "=", m[3]))
        return cls(tuple(labels), tuple(fields))

    def matches(self, obj: Obj | None) -> bool:
        if obj is None:
            return False
        labels: dict[str, str] = obj.get("metadata", {}).get("labels") or {}
        for key, op, values in self.labels:
            found = key in labels
            ok = {
                "=": found and labels[key] in values,
                "in": found and labels[key] in values,
                "!=": labels.get(key) not in values,
                "notin": labels.get(key) not in values,
                "exists": found,
                "!": not found,
            }[op]
            if not ok:
                return False
        for path, op, expected in self.fields:
            actual: Any = obj
            for part in path.split("."):
                actual = actual.get(part) if isinstance(actual, dict) else None
            text = (
                ""
                if actual is None
                else str(actual).lower()
                if isinstance(actual, bool)
                else str(actual)
            )
            if (text == expected) != (op == "="):
                return False
        return True


def _selector(request: kmock.Request) -> Selector:
    params = request.params
    return Selector.parse(params.get("labelSelector", ""), params.get("fieldSelector", ""))


def _invalid(obj: Obj, res: kmock.resource) -> list[str]:
    """The few checks a test is likely to trip over (kubernetes_validate does not make them)."""
    problems: list[str] = []
    meta = obj["metadata"]
    name, limit = meta["name"], 63 if res == JOBS else 253  # a Job's name is also a label value
    if len(name) > limit or not _DNS_SUBDOMAIN.fullmatch(name):
        problems.append(
            f'metadata.name: Invalid value: "{name}": must be a lowercase RFC 1123 subdomain '
            f"of at most {limit} characters"
        )
    spec = obj.get("spec") or {}
    template = spec.get("template") or {}
    for where, labels in (
        ("metadata.labels", meta.get("labels")),
        ("spec.template.metadata.labels", (template.get("metadata") or {}).get("labels")),
    ):
        for key, value in (labels or {}).items():
            prefix, _, short = key.rpartition("/")
            if len(short) > 63 or not _LABEL_NAME.fullmatch(short) or len(prefix) > 253:
                problems.append(f'{where}: Invalid value: "{key}": name part must be valid')
            if not isinstance(value, str) or len(value) > 63 or not _LABEL_VALUE.fullmatch(value):
                problems.append(f'{where}: Invalid value: "{value}": must be a valid label value')
    if res == SECRETS:
        problems += _secret_problems(obj)
    if res == JOBS:
        pod_spec = template.get("spec") or {}
        policy = pod_spec.get("restartPolicy")
        if policy not in ("Never", "OnFailure"):
            problems.append(
                f'spec.template.spec.restartPolicy: Unsupported value: "{policy or ""}": '
                'supported values: "OnFailure", "Never"'
            )
        containers = pod_spec.get("containers") or []
        if not containers:
            problems.append("spec.template.spec.containers: Required value")
        for n, container in enumerate(containers):
            problems += [
                f"spec.template.spec.containers[{n}].{key}: Required value"
                for key in ("name", "image")
                if not container.get(key)
            ]
    return problems


def _invalid_error(res: kmock.resource, name: str, problems: list[str]) -> kmock.KubernetesError:
    """422 Invalid, worded as the API server aggregates field errors (one, or `[a, b]`)."""
    unique = list(dict.fromkeys(problems))
    listed = unique[0] if len(unique) == 1 else f"[{', '.join(unique)}]"
    return _error(422, "Invalid", f'{_kind(res)} "{name}" is invalid: {listed}', res, name)


def _base64_error(value: Any) -> str | None:
    """Why a `data` value does not decode as Go's base64.StdEncoding (which skips CR and LF)."""
    if not isinstance(value, str):
        kind = "number" if isinstance(value, int | float) else type(value).__name__
        return f"json: cannot unmarshal {kind} into Go struct field Secret.data of type []uint8"
    text = value.replace("\r", "").replace("\n", "")
    try:
        base64.b64decode(text, validate=True)
    except binascii.Error:
        matched = _BASE64.match(text)
        end = matched.end() if matched else 0
        offset = end if end < len(text) else len(text) - len(text) % 4
        return f"illegal base64 data at input byte {offset}"
    return None


def _decoded(secret: Obj) -> dict[str, bytes]:
    return {
        key: base64.b64decode((value or "").replace("\r", "").replace("\n", ""))
        for key, value in (secret.get("data") or {}).items()
    }


def _admit_secret(secret: Obj) -> None:
    """What the API server does to a Secret's body before validating it: every `data` value
    must be base64 (else 400, from decoding), `stringData` is merged over `data` and dropped,
    `type` defaults to Opaque."""
    name = _body_name(secret)
    for key in ("data", "stringData"):
        if not isinstance(secret.get(key) or {}, dict):
            message = f'Secret in version "v1" cannot be handled as a Secret: {key} is not a map'
            raise _error(400, "BadRequest", message, SECRETS, name)
    for value in (secret.get("data") or {}).values():
        if why := _base64_error(value):
            message = f'Secret in version "v1" cannot be handled as a Secret: {why}'
            raise _error(400, "BadRequest", message, SECRETS, name)
    data = dict(secret.get("data") or {})
    for key, text in (secret.pop("stringData", None) or {}).items():
        data[key] = base64.b64encode(str(text).encode()).decode("ascii")
    if data or "data" in secret:
        secret["data"] = data
    secret.setdefault("type", "Opaque")


def _secret_problems(secret: Obj) -> list[str]:
    """ValidateSecret: keys are config keys, and the decoded data is at most 1 MiB in all."""
    problems: list[str] = []
    decoded = _decoded(secret)
    for key in decoded:
        if len(key) > 253 or not _CONFIG_KEY.fullmatch(key) or key.startswith(".."):
            problems.append(
                f'data[{key}]: Invalid value: "{key}": a valid config key must consist of '
                "alphanumeric characters, '-', '_' or '.' (e.g. 'key.name',  or 'KEY_NAME',  or "
                "'key-name', regex used for validation is '[-._a-zA-Z0-9]+')"
            )
    if sum(len(value) for value in decoded.values()) > MAX_SECRET_BYTES:
        problems.append(f"data: Too long: must have at most {MAX_SECRET_BYTES} bytes")
    return problems


def _secret_update_problems(current: Obj, new: Obj) -> list[str]:
    """ValidateSecretUpdate: the type never changes; an immutable Secret's data (and its
    immutability) neither."""
    problems: list[str] = []
    old_type, new_type = current.get("type", "Opaque"), new.get("type", "Opaque")
    if new_type != old_type:
        problems.append(f'type: Invalid value: "{new_type}": field is immutable')
    if current.get("immutable"):
        forbidden = "Forbidden: field is immutable when `immutable` is set"
        if not new.get("immutable"):
            problems.append(f"immutable: {forbidden}")
        if _decoded(new) != _decoded(current):
            problems.append(f"data: {forbidden}")
    return problems


def _message_tail(data: bytes, limit: int) -> str:
    """The last `limit` bytes, as Go's JSON encoder sends them: bad UTF-8 (a character cut at the
    start) becomes U+FFFD."""
    return data[-limit:].decode("utf-8", errors="replace") if data else ""


def _termination_message(container: Obj, written: str, log: str, exit_code: int) -> str:
    """The `message` the kubelet puts in a terminated container's state ("" for none): the end
    of what the container wrote to its terminationMessagePath, at most 4096 bytes; if that is
    empty and the policy is FallbackToLogsOnError and the exit code is not 0, the last 80 lines
    of its log, then of those the last 2048 bytes."""
    if message := _message_tail(written.encode(), MAX_MESSAGE_BYTES):
        return message
    fallback = container.get("terminationMessagePolicy") == "FallbackToLogsOnError"
    if not (fallback and exit_code != 0):
        return ""
    lines = log.split("\n")
    if lines[-1] == "":  # a newline ends the last line rather than starting another
        lines.pop()
        tail = "".join(f"{line}\n" for line in lines[-MAX_LOG_MESSAGE_LINES:])
    else:
        tail = "\n".join(lines[-MAX_LOG_MESSAGE_LINES:])
    return _message_tail(tail.encode(), MAX_LOG_MESSAGE_BYTES)


def _default_job(job: Obj) -> None:
    """What the API server adds to a Job on create: defaults, the selector, controller labels."""
    meta, spec = job["metadata"], job.setdefault("spec", {})
    template_meta = spec.setdefault("template", {}).setdefault("metadata", {})
    if not meta.get("labels") and template_meta.get("labels"):
        meta["labels"] = dict(template_meta["labels"])
    uid, name = meta["uid"], meta["name"]
    template_meta["labels"] = {
        **(template_meta.get("labels") or {}),
        "batch.kubernetes.io/controller-uid": uid,
        "batch.kubernetes.io/job-name": name,
        "controller-uid": uid,
        "job-name": name,
    }
    spec.setdefault("selector", {"matchLabels": {"batch.kubernetes.io/controller-uid": uid}})
    replacement = "Failed" if spec.get("podFailurePolicy") else "TerminatingOrFailed"
    defaults = {
        "parallelism": 1,
        "completions": 1,
        "backoffLimit": 6,
        "completionMode": "NonIndexed",
        "suspend": False,
        "manualSelector": False,
        "podReplacementPolicy": replacement,
    }
    for key, value in defaults.items():
        spec.setdefault(key, value)


@dataclass(frozen=True)
class Event:
    """One stored change, in resourceVersion order: what watches replay and the driver reacts to."""

    rv: int
    resource: kmock.resource
    type: str  # ADDED, MODIFIED or DELETED
    obj: Obj
    old: Obj | None = None
    propagation: str | None = None  # set by deletes: Orphan, Background or Foreground


@dataclass(eq=False)
class _Watch:
    request: kmock.Request
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    cut: str | None = None  # "clean" or "abrupt"


@dataclass
class _Fault:
    resource: kmock.resource
    status: int
    stored: bool
    count: int


@attrs.define(kw_only=True)
class FakeKubeAPI(kmock.KubernetesEmulator):
    """kmock's emulator with the API server's bookkeeping; reachable over HTTP or in-process.

    It still stores objects in `self.objects` (kmock's history included), so kmock's DSL works
    for assertions and interceptions: `api["create", JOBS][:1] << 500` answers the first Job
    create with 500 after it was stored, since state changes happen before any reaction.
    """

    listeners: list[Callable[[Event], None]] = attrs.field(factory=list, init=False)
    pod_logs: dict[tuple[str | None, str], str] = attrs.field(factory=dict, init=False)
    accepted_creates: list[tuple[kmock.resource, Obj]] = attrs.field(factory=list, init=False)
    _rv: int = attrs.field(default=1000, init=False)
    _log: list[Event] = attrs.field(factory=list, init=False)
    _watches: set[_Watch] = attrs.field(factory=set, init=False)
    _faults: list[_Fault] = attrs.field(factory=list, init=False)
    _expire: int = attrs.field(default=0, init=False)
    _compacted_rv: int = attrs.field(default=0, init=False)
    _closed: bool = attrs.field(default=False, init=False)
    _results: dict[int, Any] = attrs.field(factory=dict, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        logs = (self.fallback**1)[kmock.method.GET, kmock.subresource("log")]
        _ = logs << {"Content-Type": "text/plain; charset=utf-8"} << self._serve_log
        for res, namespaced in ((JOBS, True), (PODS, True), (NODES, False), (SECRETS, True)):
            info = self.resources[res]
            info.kind, info.namespaced = _kind(res), namespaced
            info.subresources = {"status"} if res in _WITH_STATUS else set()
            info.verbs = {"create", "delete", "get", "list", "patch", "update", "watch"}
        self.resources[PODS].subresources.add("log")

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        # The API server reads request bodies of up to 3 MiB (a 1 MiB Secret is 1.4 MB of
        # JSON); aiohttp's default limit is 1 MiB.
        return await super().__call__(raw_request.clone(client_max_size=MAX_REQUEST_BYTES))

    # ---- fault injection
    def fail_next_create(
        self,
        resource: str | kmock.resource = JOBS,
        *,
        status: int = 500,
        stored: bool = True,
        count: int = 1,
    ) -> None:
        """Answer the next `count` creates of `resource` with `status`: after storing the object
        (the create-succeeded-response-lost case) or, with stored=False, instead of storing it."""
        self._faults.append(_Fault(_res(resource), status, stored, count))

    def expire_next_watch(self, count: int = 1) -> None:
        """The next `count` watch requests get one 410 Gone ERROR event and end."""
        self._expire += count

    def compact(self) -> None:
        """Forget history: a watch from any resourceVersion older than now gets 410 Gone."""
        self._compacted_rv = self._rv

    def cut_watches(self, *, abrupt: bool = True) -> int:
        """End the open watch streams: by closing their connections (the client sees a broken
        payload) or, with abrupt=False, cleanly (as a server-side timeout would)."""
        for watch in self._watches:
            watch.cut = "abrupt" if abrupt else "clean"
            watch.wake.set()
        return len(self._watches)

    def close(self) -> None:
        """End open watches cleanly and new ones at once (else server shutdown waits for them)."""
        self._closed = True
        self.cut_watches(abrupt=False)

    # ---- the store: one write path for HTTP requests and the driver
    def read(self, resource: str | kmock.resource, namespace: str | None, name: str) -> Obj | None:
        key = (_res(resource), namespace, name)
        if key not in self._objects or self._objects[key].deleted:
            return None
        return copy.deepcopy(self._objects[key].raw)

    def select(
        self,
        resource: str | kmock.resource,
        namespace: str | None = None,
        selector: Selector | None = None,
    ) -> list[Obj]:
        """Current objects of a resource (all namespaces if None), sorted by namespace and name."""
        res = _res(resource)
        found = [
            copy.deepcopy(stored.raw)
            for (r, ns, _), stored in self._objects.items()
            if r == res and not stored.deleted and namespace in (None, ns)
            if selector is None or selector.matches(stored.raw)
        ]
        return sorted(
            found, key=lambda o: (o["metadata"].get("namespace") or "", o["metadata"]["name"])
        )

    def dependents(self, uid: str) -> Iterator[tuple[kmock.resource, str | None, str]]:
        for (res, ns, name), stored in list(self._objects.items()):
            refs = [] if stored.deleted else stored.raw["metadata"].get("ownerReferences") or []
            if any(ref.get("uid") == uid for ref in refs):
                yield res, ns, name

    def create(
        self,
        resource: str | kmock.resource,
        namespace: str | None,
        body: Obj,
        *,
        from_api: bool = False,
        dry_run: bool = False,
    ) -> Obj:
        """Store a new object. `from_api` applies what the API server does to a client's body."""
        res, obj = _res(resource), copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        generate = meta.get("generateName")
        name = meta.get("name") or (f"{generate}{_suffix()}" if generate else "")
        if not name:
            message = f'{_kind(res)} "" is invalid: metadata.name: Required value: name or '
            message += "generateName is required"
            raise _error(422, "Invalid", message, res)
        if namespace is not None and meta.get("namespace") not in (None, namespace):
            message = "the namespace of the provided object does not match the namespace sent "
            message += "on the request"
            raise _error(400, "BadRequest", message, res, name)
        if from_api and meta.get("resourceVersion"):
            raise _error(
                500, "InternalError", "resourceVersion should not be set on objects to be created"
            )
        namespace = namespace if namespace is not None else meta.get("namespace")
        if self.read(res, namespace, name) is not None:
            raise _error(
                409, "AlreadyExists", f'{_qualified(res)} "{name}" already exists', res, name
            )
        meta.update(name=name, uid=str(uuid4()), creationTimestamp=_now(), generation=1)
        if namespace is not None:
            meta["namespace"] = namespace
        obj.setdefault("apiVersion", _api_version(res))
        obj.setdefault("kind", _kind(res))
        if from_api:
            if res == SECRETS:
                _admit_secret(obj)
            if problems := _invalid(obj, res):
                raise _invalid_error(res, name, problems)
            if res == JOBS:
                obj["status"] = {}
                _default_job(obj)
            elif res == PODS:
                obj["status"] = {"phase": "Pending"}
        if dry_run:
            return obj
        return self._commit(res, "ADDED", obj, None)

    def patch_object(
        self,
        resource: str | kmock.resource,
        namespace: str | None,
        name: str,
        body: Obj | list[Obj],
        *,
        content_type: str = "application/merge-patch+json",
        subresource: str | None = None,
    ) -> Obj:
        res = _res(resource)
        current = self.read(res, namespace, name)
        if current is None:
            raise _not_found(res, name)
        if isinstance(body, list):
            try:
                new = jsonpatch.apply_patch(current, body)
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as e:
                raise _error(422, "Invalid", str(e), res, name) from e
        else:
            self._check_version(res, current, body)
            new = _merge(current, body, strategic="strategic" in content_type)
        new = self._protect(res, current, new, subresource)
        return self._update(res, current, self._admit(res, current, new))

    def replace(
        self,
        resource: str | kmock.resource,
        namespace: str | None,
        name: str,
        body: Obj,
        *,
        subresource: str | None = None,
    ) -> Obj:
        res = _res(resource)
        current = self.read(res, namespace, name)
        if current is None:
            raise _not_found(res, name)
        self._check_version(res, current, body)
        new = self._protect(res, current, copy.deepcopy(body), subresource)
        return self._update(res, current, self._admit(res, current, new))

    def mutate(
        self,
        resource: str | kmock.resource,
        namespace: str | None,
        name: str,
        change: Callable[[Obj], None],
        *,
        uid: str | None = None,
    ) -> Obj | None:
        """The driver's write: change a copy in place; None if gone (or replaced by a new uid)."""
        current = self.read(resource, namespace, name)
        if current is None or uid not in (None, current["metadata"]["uid"]):
            return None
        new = copy.deepcopy(current)
        change(new)
        return self._update(_res(resource), current, new)

    def delete_object(
        self,
        resource: str | kmock.resource,
        namespace: str | None,
        name: str,
        *,
        propagation: str | None = None,
        preconditions: Obj | None = None,
    ) -> Obj:
        res = _res(resource)
        current = self.read(res, namespace, name)
        if current is None:
            raise _not_found(res, name)
        meta = current["metadata"]
        for key, field_name in (("uid", "UID"), ("resourceVersion", "ResourceVersion")):
            wanted = (preconditions or {}).get(key)
            if wanted and wanted != meta[key]:
                why = f"Precondition failed: {field_name} in precondition: {wanted}, "
                why += f"{field_name} in object meta: {meta[key]}"
                raise _conflict(res, name, why)
        policy = propagation or ("Orphan" if res == JOBS else "Background")
        finalizers = list(meta.get("finalizers") or [])
        if policy == "Foreground" and "foregroundDeletion" not in finalizers:
            finalizers.append("foregroundDeletion")
        if not finalizers:
            return self._commit(res, "DELETED", copy.deepcopy(current), current, policy)
        if meta.get("deletionTimestamp"):
            return current
        marked = copy.deepcopy(current)
        marked["metadata"].update(
            deletionTimestamp=_now(), deletionGracePeriodSeconds=0, finalizers=finalizers
        )
        return self._commit(res, "MODIFIED", marked, current, policy)

    def _check_version(self, res: kmock.resource, current: Obj, body: Obj) -> None:
        wanted = (body.get("metadata") or {}).get("resourceVersion")
        if wanted and wanted != current["metadata"]["resourceVersion"]:
            why = "the object has been modified; please apply your changes to the latest "
            why += "version and try again"
            raise _conflict(res, current["metadata"]["name"], why)

    def _protect(self, res: kmock.resource, current: Obj, new: Obj, subresource: str | None) -> Obj:
        """What a client cannot change: identity fields; status outside /status and vice versa."""
        meta = new.setdefault("metadata", {})
        for key in (
            "name",
            "namespace",
            "uid",
            "creationTimestamp",
            "deletionTimestamp",
            "generation",
        ):
            if key in current["metadata"]:
                meta[key] = current["metadata"][key]
            else:
                meta.pop(key, None)
        if subresource == "status":
            return {**copy.deepcopy(current), "status": new.get("status", {})}
        if res in _WITH_STATUS:
            new["status"] = current.get("status", {})
        return new

    def _admit(self, res: kmock.resource, current: Obj, new: Obj) -> Obj:
        """A client's update of a Secret: decoded and validated as on create, plus the update
        rules (422 for an immutable Secret's data, in the API server's words)."""
        if res != SECRETS:
            return new
        _admit_secret(new)
        problems = _secret_update_problems(current, new) + _invalid(new, res)
        if problems:
            raise _invalid_error(res, current["metadata"]["name"], problems)
        return new

    def _update(self, res: kmock.resource, current: Obj, new: Obj) -> Obj:
        new = copy.deepcopy(new)  # a merge shares sub-dicts with `current`, which the event keeps
        new.setdefault("metadata", {})["resourceVersion"] = current["metadata"]["resourceVersion"]
        if new == current:
            return current  # a no-op write: no new resourceVersion, no event
        if new.get("spec") != current.get("spec"):
            new["metadata"]["generation"] = current["metadata"].get("generation", 1) + 1
        meta = new["metadata"]
        if (
            meta.get("deletionTimestamp")
            and current["metadata"].get("finalizers")
            and not meta.get("finalizers")
        ):
            return self._commit(res, "DELETED", new, current)  # the last finalizer is gone
        return self._commit(res, "MODIFIED", new, current)

    def _commit(
        self,
        res: kmock.resource,
        kind: str,
        obj: Obj,
        old: Obj | None,
        propagation: str | None = None,
    ) -> Obj:
        """Stamp a resourceVersion, store, log the event, wake the watches, tell the listeners."""
        self._rv += 1
        meta = obj["metadata"]
        meta["resourceVersion"] = str(self._rv)
        key = (res, meta.get("namespace"), meta["name"])
        if kind == "DELETED":
            self._objects[key].delete()
        elif key in self._objects:
            self._objects[key].history.append(obj)
        else:
            self._objects[key] = obj
        event = Event(self._rv, res, kind, copy.deepcopy(obj), old, propagation)
        self._log.append(event)
        for watch in self._watches:
            watch.wake.set()
        for listener in list(self.listeners):
            listener(event)
        return copy.deepcopy(obj)

    # ---- HTTP: state changes first (as kmock does), then reactions and the fallbacks below
    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        if request.resource is not None:
            watch = request.params.get("watch", "").lower() in ("true", "1")
            if request.method == kmock.method.GET and watch:  # kmock knows only ?watch=true
                object.__setattr__(request, "action", kmock.action.WATCH)
            elif request.method == kmock.method.PUT and request.name:
                object.__setattr__(request, "action", kmock.action.UPDATE)
            self._results[request.id] = self._apply(request)
        try:
            return await super(kmock.KubernetesEmulator, self)._handle(request)  # skip its store
        finally:
            self._results.pop(request.id, None)

    def _apply(self, request: kmock.Request) -> Any:
        res, ns, name = request.resource, request.namespace, request.name
        assert res is not None
        data = request.data if isinstance(request.data, dict | list) else {}
        body: Obj = data if isinstance(data, dict) else {}  # a JSON patch is the only list
        if request.action == kmock.action.CREATE:
            fault = next((f for f in self._faults if f.resource == res and f.count > 0), None)
            if fault:
                fault.count -= 1
                if not fault.stored:
                    raise _error(
                        fault.status, "InternalError", "Internal error occurred: injected fault"
                    )
            dry_run = bool(request.params.get("dryRun"))
            created = self.create(res, ns, body, from_api=True, dry_run=dry_run)
            if not dry_run:
                self.accepted_creates.append((res, copy.deepcopy(body)))
            if fault:
                message = "Internal error occurred: injected fault after the object was stored"
                raise _error(
                    fault.status, "InternalError", message, res, created["metadata"]["name"]
                )
            return created
        if request.action == kmock.action.UPDATE and name and request.method == kmock.method.PUT:
            return self.replace(res, ns, name, body, subresource=request.subresource)
        if request.action == kmock.action.UPDATE and name:
            content_type = request.headers.get("Content-Type", "")
            return self.patch_object(
                res, ns, name, data, content_type=content_type, subresource=request.subresource
            )
        if request.action == kmock.action.DELETE and name:
            policy = request.params.get("propagationPolicy") or body.get("propagationPolicy")
            if request.params.get("orphanDependents") == "true" or body.get("orphanDependents"):
                policy = "Orphan"
            return self.delete_object(
                res, ns, name, propagation=policy, preconditions=body.get("preconditions")
            )
        return None

    async def _serve_list(self, request: kmock.Request) -> Obj:
        res = request.resource
        assert res is not None
        items = self.select(res, request.namespace, _selector(request))
        return {
            "apiVersion": _api_version(res),
            "kind": f"{_kind(res)}List",
            "metadata": {"resourceVersion": str(self._rv)},
            "items": items,
        }

    async def _serve_fetch(self, request: kmock.Request) -> Obj:
        assert request.resource is not None
        assert request.name is not None
        obj = self.read(request.resource, request.namespace, request.name)
        if obj is None:
            raise _not_found(request.resource, request.name)
        return obj

    async def _serve_create(self, request: kmock.Request) -> Any:
        return self._results[request.id]

    async def _serve_update(self, request: kmock.Request) -> Any:
        return self._results[request.id]

    async def _serve_delete(self, request: kmock.Request) -> Any:
        res, obj = request.resource, self._results[request.id]
        assert res is not None
        assert request.name is not None
        if res == PODS or self.read(res, request.namespace, request.name) is not None:
            return obj  # pods and objects still being finalised come back whole
        details = {
            "name": request.name,
            "group": res.group,
            "kind": res.plural,
            "uid": obj["metadata"]["uid"],
        }
        return {
            "apiVersion": "v1",
            "kind": "Status",
            "metadata": {},
            "status": "Success",
            "details": details,
        }

    async def _serve_log(self, request: kmock.Request) -> bytes:
        name, ns = request.name or "", request.namespace
        pod = self.read(PODS, ns, name)
        if pod is None:
            raise _not_found(PODS, name)
        statuses = pod.get("status", {}).get("containerStatuses") or []
        if not any("running" in s["state"] or "terminated" in s["state"] for s in statuses):
            container = pod["spec"]["containers"][0]["name"]
            waiting = statuses[0]["state"].get("waiting", {}).get("reason") if statuses else None
            why = {
                "ErrImagePull": "trying and failing to pull image",
                "ImagePullBackOff": "image can't be pulled",
            }
            cause = why.get(waiting or "", "ContainerCreating")
            message = f'container "{container}" in pod "{name}" is waiting to start: {cause}'
            raise _error(400, "BadRequest", message, PODS, name)
        text = self.pod_logs.get((ns, name), "")
        if tail := request.params.get("tailLines"):
            text = "".join(text.splitlines(keepends=True)[-int(tail) :]) if int(tail) else ""
        data = text.encode()
        if limit := request.params.get("limitBytes"):
            data = data[: int(limit)]
        return data

    async def _serve_watch(self, request: kmock.Request) -> AsyncIterator[Any]:
        # Send the headers now: a stream that ends before its first chunk disables the reaction.
        yield b""
        res, since = request.resource, request.params.get("resourceVersion") or "0"
        assert res is not None
        selector = _selector(request)
        if self._expire > 0 or (since != "0" and int(since) < self._compacted_rv):
            self._expire = max(0, self._expire - 1)
            yield _gone(since, self._rv)
            return
        if since == "0":  # no resourceVersion: the current state first, as synthetic ADDED events
            for obj in self.select(res, request.namespace, selector):
                if request.name in (None, obj["metadata"]["name"]):
                    yield {"type": "ADDED", "object": obj}
            position = len(self._log)
        else:
            position = bisect.bisect_right(self._log, int(since), key=lambda e: e.rv)
        timeout = request.params.get("timeoutSeconds")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + float(timeout) if timeout else None
        watch = _Watch(request)
        self._watches.add(watch)
        try:
            while watch.cut is None and not self._closed:
                watch.wake.clear()
                while position < len(self._log):
                    event = self._project(self._log[position], request, selector)
                    position += 1
                    if event is not None:
                        yield event
                remaining = None if deadline is None else deadline - loop.time()
                if remaining is not None and remaining <= 0:
                    break
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(remaining):
                        await watch.wake.wait()
            raw = request._raw_request
            if watch.cut == "abrupt" and raw is not None and raw.transport is not None:
                raw.transport.close()  # the chunked body never ends: the client's payload breaks
        finally:
            self._watches.discard(watch)

    def _project(self, event: Event, request: kmock.Request, selector: Selector) -> Obj | None:
        """How one stored change looks through a watch's filters (what the API server sends)."""
        meta = event.obj["metadata"]
        if event.resource != request.resource or request.namespace not in (
            None,
            meta.get("namespace"),
        ):
            return None
        if request.name not in (None, meta["name"]):
            return None
        was = event.old is not None and selector.matches(event.old)
        now = selector.matches(event.obj)
        if event.type == "DELETED":
            kind = "DELETED" if now or was else None
        else:
            kind = ("MODIFIED" if was else "ADDED") if now else ("DELETED" if was else None)
        return None if kind is None else {"type": kind, "object": event.obj}


# ---- scenarios: what happens to a Job's pod, chosen per Job by `FakeCluster.script`
# What a container writes to its terminationMessagePath: a text, or a function of the files it
# sees in its secret volumes ({path: text}, as `FakeCluster.files` gives them).
Message = str | Callable[[dict[str, str]], str]


@dataclass(frozen=True)
class Succeed:
    after_s: float = 0.1
    log: str = ""
    message: Message = ""


@dataclass(frozen=True)
class Fail:
    exit_code: int = 1
    after_s: float = 0.1
    log: str = ""
    message: Message = ""


@dataclass(frozen=True)
class RunUntilDeleted:
    log: str = ""


@dataclass(frozen=True)
class ImagePullBackOff:
    """ErrImagePull, then ImagePullBackOff until the pod goes (a registry that does not answer)."""

    backoff_after_s: float = 0.1
    message: str = (
        'rpc error: code = DeadlineExceeded desc = failed to pull and unpack image "{image}": '
        'failed to resolve reference "{image}": failed to do request: '
        "dial tcp 10.0.0.53:443: i/o timeout"
    )


@dataclass(frozen=True)
class ImageNotFound:
    """Like ImagePullBackOff, with the runtime's "not found" (CRI-O says "manifest unknown")."""

    backoff_after_s: float = 0.1
    message: str = (
        'rpc error: code = NotFound desc = failed to pull and unpack image "{image}": '
        'failed to resolve reference "{image}": {image}: not found'
    )


@dataclass(frozen=True)
class Unschedulable:
    message: str = (
        "0/3 nodes are available: 3 Insufficient nvidia.com/gpu. preemption: 0/3 nodes are "
        "available: 3 No preemption victims found for incoming pod."
    )


@dataclass(frozen=True)
class DeadlineExceeded:
    """Runs, then the Job controller gives up after `after_s` as for activeDeadlineSeconds."""

    after_s: float = 0.1
    log: str = ""


@dataclass(frozen=True)
class Evicted:
    """Runs, then is disrupted: EvictionByEvictionAPI (the pod is deleted), TerminationByKubelet
    (node pressure: the pod stays, Failed, reason Evicted), PreemptionByScheduler, ..."""

    after_s: float = 0.1
    reason: str = "EvictionByEvictionAPI"
    log: str = ""


Scenario = (
    Succeed
    | Fail
    | RunUntilDeleted
    | ImagePullBackOff
    | ImageNotFound
    | Unschedulable
    | DeadlineExceeded
    | Evicted
)
_EVICTION_MESSAGES = {
    "EvictionByEvictionAPI": "Eviction API: evicting",
    "TerminationByKubelet": "The node was low on resource: memory. "
    "Threshold quantity: 100Mi, available: 51200Ki. ",
    "PreemptionByScheduler": "Preempted in order to admit critical pod",
    "DeletionByTaintManager": "Taint manager: deleting due to NoExecute taint",
}


def _set_condition(
    conditions: list[Obj],
    kind: str,
    status: bool,
    reason: str | None = None,
    message: str | None = None,
    *,
    probe: bool = False,
    clock: str = "lastProbeTime",
) -> None:
    """Set a condition in place; lastTransitionTime moves only when the status changes.
    `clock` is lastProbeTime (pods, Jobs: null unless `probe`) or lastHeartbeatTime (nodes)."""
    value, now = "True" if status else "False", _now()
    found = next((c for c in conditions if c["type"] == kind), None)
    if found is None:
        found = {"type": kind, "status": value, clock: None, "lastTransitionTime": now}
        conditions.append(found)
    elif found["status"] != value:
        found.update(status=value, lastTransitionTime=now)
    if probe:
        found[clock] = now
    for key, text in (("reason", reason), ("message", message)):
        if text:
            found[key] = text
        else:
            found.pop(key, None)


def _failure_reason(job: Obj, pod: str, exit_code: int | None, disrupted: bool) -> tuple[str, str]:
    """The Job's Failed reason: the first matching podFailurePolicy rule, if it says FailJob."""
    ns = job["metadata"]["namespace"]
    container = job["spec"]["template"]["spec"]["containers"][0]["name"]
    for n, rule in enumerate((job["spec"].get("podFailurePolicy") or {}).get("rules") or []):
        codes = rule.get("onExitCodes")
        conditions = rule.get("onPodConditions") or []
        if codes and exit_code:
            if (exit_code in codes.get("values", [])) != (codes.get("operator") == "In"):
                continue
            why = f"Container {container} for pod {ns}/{pod} failed with exit code {exit_code}"
        elif disrupted and any(
            c.get("type") == "DisruptionTarget" and c.get("status", "True") == "True"
            for c in conditions
        ):
            why = f"Pod {ns}/{pod} has condition DisruptionTarget"
        else:
            continue
        if rule.get("action") == "FailJob":
            return "PodFailurePolicy", f"{why} matching FailJob rule at index {n}"
        break
    return "BackoffLimitExceeded", "Job has reached the specified backoff limit"


def _qos(spec: Obj) -> str:
    resources = [c.get("resources") or {} for c in spec.get("containers") or []]
    if not any(r.get("requests") or r.get("limits") for r in resources):
        return "BestEffort"
    guaranteed = all(
        all(key in (r.get("limits") or {}) for key in ("cpu", "memory"))
        and all(
            (r.get("requests") or {}).get(k, v) == v for k, v in (r.get("limits") or {}).items()
        )
        for r in resources
    )
    return "Guaranteed" if guaranteed else "Burstable"


@dataclass(eq=False)
class _Run:
    """One Job's pod as the driver walks it."""

    job: Obj
    pod: str
    gone: asyncio.Event = field(default_factory=asyncio.Event)  # the pod was deleted
    # a Secret of the pod's namespace was written, or the pod was deleted: look at the volumes
    volumes: asyncio.Event = field(default_factory=asyncio.Event)
    files: dict[str, str] = field(default_factory=dict)  # {path: text} in its secret volumes
    written: str = ""  # what the container wrote to its terminationMessagePath
    started_at: str | None = None
    container_id: str = field(default_factory=lambda: f"containerd://{uuid4().hex}{uuid4().hex}")

    @property
    def ns(self) -> str:
        return str(self.job["metadata"]["namespace"])

    @property
    def name(self) -> str:
        return str(self.job["metadata"]["name"])


class FakeCluster:
    """The controllers and kubelets of the fake cluster, and what tests assert on.

    Reacts to the API's events in-process: a new Job gets its pod, which walks through the
    scenario `script(job)` returns (default: succeed quickly); deleting a Job collects its pods.
    No pod runs without a node: add one with `add_node` first.
    """

    def __init__(
        self,
        api: FakeKubeAPI,
        url: str,
        *,
        script: Callable[[Obj], Scenario] | None = None,
        gc_delay_s: float = 0.1,
        step_s: float = 0.02,
    ) -> None:
        self.api, self.url = api, url
        self.script: Callable[[Obj], Scenario] = script or (lambda job: Succeed())
        self.gc_delay_s = gc_delay_s  # from a Job's deletion to its pods' deletion
        self.step_s = step_s  # between the pod's intermediate states
        self.errors: list[BaseException] = []  # failures of the driver itself, raised by close()
        self._runs: dict[tuple[str, str], _Run] = {}  # by the pod's (namespace, name)
        self._tasks: set[asyncio.Task[None]] = set()
        api.listeners.append(self._on_event)

    # ---- what tests look at
    @property
    def jobs(self) -> dict[str, Obj]:
        """Current Jobs (all namespaces) by name."""
        return {j["metadata"]["name"]: j for j in self.api.select(JOBS)}

    @property
    def pods(self) -> dict[str, Obj]:
        return {p["metadata"]["name"]: p for p in self.api.select(PODS)}

    @property
    def nodes(self) -> dict[str, Obj]:
        return {n["metadata"]["name"]: n for n in self.api.select(NODES)}

    @property
    def secrets(self) -> dict[str, Obj]:
        """Current Secrets (all namespaces) by name."""
        return {s["metadata"]["name"]: s for s in self.api.select(SECRETS)}

    def files(self, pod: str) -> dict[str, str]:
        """What the pod's container saw in its secret volumes when it started ({} before, or
        for a pod the driver never ran): {f"{mountPath}/{path}": the decoded text}."""
        run = next((r for (_, name), r in self._runs.items() if name == pod), None)
        return dict(run.files) if run is not None else {}

    @property
    def created_jobs(self) -> list[Obj]:
        """The body of every Job create the API accepted (stored), in order."""
        return [body for res, body in self.api.accepted_creates if res == JOBS]

    @property
    def create_counts(self) -> Counter[str]:
        """Accepted Job creates per name (a name counts again after a delete and re-create)."""
        return Counter(_body_name(body) for body in self.created_jobs)

    @property
    def create_attempts(self) -> Counter[str]:
        """Every Job create request per name, refused ones (409, 422, injected faults) included."""
        creates = (r for r in self.api if r.action == kmock.action.CREATE and r.resource == JOBS)
        return Counter(_body_name(r.data if isinstance(r.data, dict) else {}) for r in creates)

    def pods_of(self, job: str) -> list[Obj]:
        return [
            p
            for p in self.api.select(PODS)
            if p["metadata"].get("labels", {}).get("job-name") == job
        ]

    def configuration(self) -> client.Configuration:
        return client.Configuration(host=self.url)

    async def wait_for(
        self, check: Callable[[], T], timeout: float = 5.0, interval: float = 0.01
    ) -> T:
        """Poll until check() is truthy and return it; TimeoutError after `timeout` seconds."""
        async with asyncio.timeout(timeout):
            while True:
                if result := check():
                    return result
                await asyncio.sleep(interval)

    # ---- faults (see FakeKubeAPI)
    def fail_next_create(
        self,
        resource: str | kmock.resource = JOBS,
        *,
        status: int = 500,
        stored: bool = True,
        count: int = 1,
    ) -> None:
        self.api.fail_next_create(resource, status=status, stored=stored, count=count)

    def expire_next_watch(self, count: int = 1) -> None:
        self.api.expire_next_watch(count)

    def compact(self) -> None:
        self.api.compact()

    def cut_watches(self, *, abrupt: bool = True) -> int:
        return self.api.cut_watches(abrupt=abrupt)

    # ---- nodes
    def add_node(
        self,
        name: str,
        cpu: str = "4",
        memory: str = "8Gi",
        gpu: int = 0,
        labels: dict[str, str] | None = None,
        ready: bool = True,
        unschedulable: bool = False,
    ) -> Obj:
        amounts = {"cpu": cpu, "memory": memory, "pods": "110", "ephemeral-storage": "100Gi"}
        if gpu:
            amounts["nvidia.com/gpu"] = str(gpu)
        address = f"10.0.0.{len(self.api.select(NODES)) + 10}"
        status = {
            "capacity": amounts,
            "allocatable": dict(amounts),
            "addresses": [
                {"type": "InternalIP", "address": address},
                {"type": "Hostname", "address": name},
            ],
            "conditions": [
                {
                    "type": kind,
                    "status": "False",
                    "reason": reason,
                    "message": message,
                    "lastHeartbeatTime": _now(),
                    "lastTransitionTime": _now(),
                }
                for kind, reason, message in (
                    (
                        "MemoryPressure",
                        "KubeletHasSufficientMemory",
                        "kubelet has sufficient memory available",
                    ),
                    ("DiskPressure", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
                    (
                        "PIDPressure",
                        "KubeletHasSufficientPID",
                        "kubelet has sufficient PID available",
                    ),
                )
            ],
            "nodeInfo": {  # the client's model requires every field
                "architecture": "amd64",
                "bootID": str(uuid4()),
                "containerRuntimeVersion": "containerd://1.7.20",
                "kernelVersion": "6.8.0",
                "kubeProxyVersion": "v1.31.0",
                "kubeletVersion": "v1.31.0",
                "machineID": uuid4().hex,
                "operatingSystem": "linux",
                "osImage": "Ubuntu 24.04 LTS",
                "systemUUID": str(uuid4()),
            },
        }
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "labels": {
                    "kubernetes.io/hostname": name,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                    **(labels or {}),
                },
            },
            "spec": {},
            "status": status,
        }
        _node_ready(node, ready)
        _node_cordoned(node, unschedulable)
        return self.api.create(NODES, None, node)

    def set_node_ready(self, name: str, ready: bool) -> None:
        self._node(name, lambda node: _node_ready(node, ready))

    def cordon(self, name: str) -> None:
        self._node(name, lambda node: _node_cordoned(node, True))

    def uncordon(self, name: str) -> None:
        self._node(name, lambda node: _node_cordoned(node, False))

    def remove_node(self, name: str) -> None:
        self.api.delete_object(NODES, None, name)

    def _node(self, name: str, change: Callable[[Obj], None]) -> None:
        if self.api.mutate(NODES, None, name, change) is None:
            raise KeyError(f"no node {name!r}")

    def _place(self, spec: Obj) -> tuple[str | None, str]:
        """The scheduler: the first fitting node, or why none fits (in the scheduler's words)."""
        nodes = self.api.select(NODES)
        wanted = spec.get("nodeSelector") or {}
        gpus = sum(
            int(((c.get("resources") or {}).get("limits") or {}).get("nvidia.com/gpu", 0))
            for c in spec.get("containers") or []
        )
        misfits: Counter[str] = Counter()
        for node in nodes:
            labels = node["metadata"].get("labels") or {}
            ready = any(
                c["type"] == "Ready" and c["status"] == "True" for c in node["status"]["conditions"]
            )
            if any(labels.get(k) != v for k, v in wanted.items()):
                misfits["node(s) didn't match Pod's node affinity/selector"] += 1
            elif node["spec"].get("unschedulable"):
                misfits["node(s) were unschedulable"] += 1
            elif not ready:
                misfits["node(s) had untolerated taint {node.kubernetes.io/not-ready: }"] += 1
            elif gpus > int(node["status"]["allocatable"].get("nvidia.com/gpu", 0)):
                misfits["Insufficient nvidia.com/gpu"] += 1
            else:
                return node["metadata"]["name"], ""
        reasons = ", ".join(f"{count} {why}" for why, count in sorted(misfits.items()))
        total = len(nodes)
        tail = (
            f" preemption: 0/{total} nodes are available: "
            f"{total} Preemption is not helpful for scheduling."
            if total
            else ""
        )
        return None, f"0/{total} nodes are available: {reasons}.{tail}"

    # ---- reacting to the API
    def _on_event(self, event: Event) -> None:
        meta = event.obj["metadata"]
        if event.resource == JOBS and event.type == "ADDED":
            self._spawn(self._run_job(event.obj))
        if event.resource == PODS and event.type == "DELETED":
            key = (meta["namespace"], meta["name"])
            self.api.pod_logs.pop(key, None)
            if run := self._runs.get(key):
                run.gone.set()
                run.volumes.set()
        if event.resource == SECRETS and event.type != "DELETED":
            for (ns, _), run in self._runs.items():
                if ns == meta.get("namespace"):
                    run.volumes.set()
        if event.propagation in ("Background", "Foreground"):
            if event.type == "DELETED" or event.propagation == "Foreground":
                self._spawn(self._collect(event.resource, event.obj, event.propagation))
        elif event.propagation == "Orphan" and event.type == "DELETED":
            self._spawn(self._orphan(meta["uid"]))

    def _spawn(self, coro: Any) -> None:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._reap)

    def _reap(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.errors.append(task.exception())  # type: ignore[arg-type]  # checked above

    async def _collect(self, res: kmock.resource, owner: Obj, policy: str) -> None:
        """The garbage collector: delete the dependents, then let a Foreground owner go."""
        await asyncio.sleep(self.gc_delay_s)
        meta = owner["metadata"]
        for dep_res, ns, name in list(self.api.dependents(meta["uid"])):
            with contextlib.suppress(kmock.KubernetesError):
                self.api.delete_object(dep_res, ns, name, propagation="Background")
        if policy == "Foreground":

            def release(obj: Obj) -> None:
                obj["metadata"]["finalizers"] = [
                    f for f in obj["metadata"]["finalizers"] if f != "foregroundDeletion"
                ]

            self.api.mutate(res, meta.get("namespace"), meta["name"], release, uid=meta["uid"])

    async def _orphan(self, uid: str) -> None:
        def drop(obj: Obj) -> None:
            refs = [r for r in obj["metadata"]["ownerReferences"] if r.get("uid") != uid]
            obj["metadata"]["ownerReferences"] = refs
            if not refs:
                del obj["metadata"]["ownerReferences"]

        for res, ns, name in list(self.api.dependents(uid)):
            self.api.mutate(res, ns, name, drop)

    # ---- the Job controller and the kubelet, one task per Job
    async def _run_job(self, job: Obj) -> None:
        scenario = self.script(job)
        pod = self.api.create(PODS, job["metadata"]["namespace"], self._pod_for(job))
        run = _Run(job, pod["metadata"]["name"])
        self._runs[(run.ns, run.pod)] = run

        def started(j: Obj) -> None:
            j["status"].update(
                active=1, ready=0, terminating=0, startTime=_now(), uncountedTerminatedPods={}
            )

        self._job(run, started)
        try:
            async with asyncio.timeout(job["spec"].get("activeDeadlineSeconds")):
                await self._play(run, scenario)
        except TimeoutError:
            await self._deadline(run)

    async def _play(self, run: _Run, scenario: Scenario) -> None:
        """Walk the pod (and the Job) through `scenario`; a pod deleted on the way fails the Job."""
        if isinstance(scenario, Unschedulable):
            self._unschedulable(run, scenario.message)
            await run.gone.wait()
            self._pod_lost(run, None)
            return
        node = await self._schedule(run)
        if node is None or await self._bind(run, node) or await self._mount(run):
            self._pod_lost(run, None)
            return
        if isinstance(scenario, ImagePullBackOff | ImageNotFound):
            image = run.job["spec"]["template"]["spec"]["containers"][0]["image"]
            message = scenario.message.format(image=image)
            self._waiting(run, "ErrImagePull", message)
            if not await self._hold(run, scenario.backoff_after_s):
                self._waiting(
                    run,
                    "ImagePullBackOff",
                    f'Back-off pulling image "{image}": ErrImagePull: {message}',
                )
                await run.gone.wait()
            self._pod_lost(run, None)
            return
        self._start(run, scenario.log)
        if isinstance(scenario, RunUntilDeleted):
            await run.gone.wait()
        elif await self._hold(run, scenario.after_s):
            pass  # deleted while running
        elif isinstance(scenario, DeadlineExceeded):
            await self._deadline(run)
        elif isinstance(scenario, Evicted):
            await self._evict(run, scenario.reason)
        else:
            code = scenario.exit_code if isinstance(scenario, Fail) else 0
            output = scenario.message
            run.written = output(dict(run.files)) if callable(output) else output
            self._terminate(run, code)
            if code == 0:
                self._complete(run)
            else:
                self._fail_job(run, *_failure_reason(run.job, run.pod, code, False), final=True)
            return
        if run.gone.is_set():
            self._pod_lost(run, 143)  # killed by SIGTERM

    async def _hold(self, run: _Run, seconds: float) -> bool:
        """Wait `seconds`; True if the pod was deleted meanwhile."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await run.gone.wait()
        return run.gone.is_set()

    async def _schedule(self, run: _Run) -> str | None:
        shown = None
        while True:
            node, why = self._place(run.job["spec"]["template"]["spec"])
            if node is not None:
                return node
            if why != shown:
                self._unschedulable(run, why)
                shown = why
            if await self._hold(run, self.step_s * 5):
                return None

    async def _mount(self, run: _Run) -> bool:
        """The kubelet's volume manager: the container stays ContainerCreating until every
        secret volume can be set up (its Secret exists, or it is optional, and so do the keys
        its `items` name), woken by the Secrets' events; True if the pod went meanwhile."""
        while True:
            run.volumes.clear()
            if run.gone.is_set():
                return True
            files = self._secret_files(run)
            if files is not None:
                run.files = files
                return False
            await run.volumes.wait()

    def _secret_files(self, run: _Run) -> dict[str, str] | None:
        """{f"{mountPath}/{path}": text} of the secret volumes as the container sees them; None
        while one cannot be mounted (the kubelet's "secret ... not found")."""
        spec = run.job["spec"]["template"]["spec"]
        payloads: dict[str, dict[str, str]] = {}
        for volume in spec.get("volumes") or []:
            source = volume.get("secret")
            if source is None:
                continue
            optional = bool(source.get("optional"))
            secret = self.api.read(SECRETS, run.ns, source.get("secretName") or "")
            if secret is None:
                if not optional:
                    return None
                payloads[volume["name"]] = {}
                continue
            data = {k: v.decode("utf-8", errors="replace") for k, v in _decoded(secret).items()}
            if source.get("items"):
                mapped = {}
                for item in source["items"]:
                    if item["key"] in data:
                        mapped[item["path"]] = data[item["key"]]
                    elif not optional:
                        return None  # "references non-existent secret key"
                payloads[volume["name"]] = mapped
            else:
                payloads[volume["name"]] = data
        files: dict[str, str] = {}
        for mount in spec["containers"][0].get("volumeMounts") or []:
            payload = payloads.get(mount["name"])
            if payload is None:
                continue
            root, sub = mount["mountPath"].rstrip("/"), (mount.get("subPath") or "").strip("/")
            for path, text in payload.items():
                if not sub:
                    files[f"{root}/{path}"] = text
                elif path == sub:
                    files[root] = text
                elif path.startswith(f"{sub}/"):
                    files[f"{root}/{path.removeprefix(sub + '/')}"] = text
        return files

    def _pod(self, run: _Run, change: Callable[[Obj], None]) -> None:
        self.api.mutate(PODS, run.ns, run.pod, change)

    def _job(self, run: _Run, change: Callable[[Obj], None]) -> None:
        self.api.mutate(JOBS, run.ns, run.name, change, uid=run.job["metadata"]["uid"])

    def _container(self, run: _Run, pod: Obj, state: Obj, ready: bool = False) -> Obj:
        spec = pod["spec"]["containers"][0]
        started = "running" in state or "terminated" in state
        status = {
            "name": spec["name"],
            "image": spec["image"],
            "imageID": f"{spec['image']}@sha256:{'0' * 64}" if started else "",
            "ready": ready,
            "restartCount": 0,
            "started": "running" in state,
            "state": state,
            "lastState": {},
        }
        if started:
            status["containerID"] = run.container_id
        return status

    def _unschedulable(self, run: _Run, message: str) -> None:
        def change(pod: Obj) -> None:
            conditions = pod["status"].setdefault("conditions", [])
            _set_condition(conditions, "PodScheduled", False, "Unschedulable", message)

        self._pod(run, change)

    async def _bind(self, run: _Run, node: str) -> bool:
        """Put the pod on `node`, its container being created; True if the pod went meanwhile."""
        node_obj = self.api.read(NODES, None, node) or {}
        address = next(
            a["address"] for a in node_obj["status"]["addresses"] if a["type"] == "InternalIP"
        )

        def change(pod: Obj) -> None:
            pod["spec"]["nodeName"] = node
            status = pod["status"]
            status.update(
                phase="Pending", hostIP=address, hostIPs=[{"ip": address}], startTime=_now()
            )
            unready = f"containers with unready status: [{pod['spec']['containers'][0]['name']}]"
            conditions = status.setdefault("conditions", [])
            _set_condition(conditions, "PodReadyToStartContainers", False)
            _set_condition(conditions, "Initialized", True)
            _set_condition(conditions, "Ready", False, "ContainersNotReady", unready)
            _set_condition(conditions, "ContainersReady", False, "ContainersNotReady", unready)
            _set_condition(conditions, "PodScheduled", True)
            status["containerStatuses"] = [
                self._container(run, pod, {"waiting": {"reason": "ContainerCreating"}})
            ]

        self._pod(run, change)
        return await self._hold(run, self.step_s)

    def _waiting(self, run: _Run, reason: str, message: str) -> None:
        def change(pod: Obj) -> None:
            _set_condition(pod["status"]["conditions"], "PodReadyToStartContainers", True)
            state = {"waiting": {"reason": reason, "message": message}}
            pod["status"]["containerStatuses"] = [self._container(run, pod, state)]

        self._pod(run, change)

    def _start(self, run: _Run, log: str) -> None:
        run.started_at = _now()
        self.api.pod_logs[(run.ns, run.pod)] = log

        def change(pod: Obj) -> None:
            ip = f"10.244.{random.randint(0, 255)}.{random.randint(2, 254)}"
            pod["status"].update(phase="Running", podIP=ip, podIPs=[{"ip": ip}])
            for kind in ("PodReadyToStartContainers", "Ready", "ContainersReady"):
                _set_condition(pod["status"]["conditions"], kind, True)
            state = {"running": {"startedAt": run.started_at}}
            pod["status"]["containerStatuses"] = [self._container(run, pod, state, ready=True)]

        self._pod(run, change)
        self._job(run, lambda job: job["status"].update(ready=1))

    def _terminate(
        self, run: _Run, exit_code: int, extra: Callable[[Obj], None] | None = None
    ) -> None:
        """The container ends; a container that never started just leaves the pod Failed."""

        def change(pod: Obj) -> None:
            phase = "Succeeded" if exit_code == 0 else "Failed"
            pod["status"]["phase"] = phase
            conditions = pod["status"].setdefault("conditions", [])
            for kind in ("Ready", "ContainersReady"):
                _set_condition(
                    conditions, kind, False, "PodCompleted" if exit_code == 0 else "PodFailed"
                )
            if run.started_at is not None:
                terminated = {
                    "exitCode": exit_code,
                    "reason": "Completed" if exit_code == 0 else "Error",
                    "startedAt": run.started_at,
                    "finishedAt": _now(),
                    "containerID": run.container_id,
                }
                log = self.api.pod_logs.get((run.ns, run.pod), "")
                container = pod["spec"]["containers"][0]
                if message := _termination_message(container, run.written, log, exit_code):
                    terminated["message"] = message
                state = {"terminated": terminated}
                pod["status"]["containerStatuses"] = [self._container(run, pod, state)]
            if extra is not None:
                extra(pod)

        self._pod(run, change)

    def _complete(self, run: _Run) -> None:
        def change(job: Obj) -> None:
            status = job["status"]
            status.pop("active", None)
            status.update(succeeded=1, ready=0, terminating=0, completionTime=_now())
            conditions = status.setdefault("conditions", [])
            message = "Reached expected number of succeeded pods"
            for kind in ("SuccessCriteriaMet", "Complete"):
                _set_condition(conditions, kind, True, "CompletionsReached", message, probe=True)

        self._job(run, change)
        self._spawn(self._expire(run))

    def _fail_job(self, run: _Run, reason: str, message: str, *, final: bool) -> None:
        """FailureTarget as soon as the controller decides; Failed once the pod terminated."""

        def change(job: Obj) -> None:
            status = job["status"]
            conditions = status.setdefault("conditions", [])
            _set_condition(conditions, "FailureTarget", True, reason, message, probe=True)
            if final:
                status.pop("active", None)
                status.update(failed=1, ready=0, terminating=0)
                _set_condition(conditions, "Failed", True, reason, message, probe=True)

        self._job(run, change)
        if final:
            self._spawn(self._expire(run))

    async def _expire(self, run: _Run) -> None:
        """The TTL controller: a finished Job with ttlSecondsAfterFinished goes, with its pods."""
        ttl = run.job["spec"].get("ttlSecondsAfterFinished")
        if ttl is None:
            return
        await asyncio.sleep(ttl)
        with contextlib.suppress(kmock.KubernetesError):  # already gone, or another Job now
            precondition = {"uid": run.job["metadata"]["uid"]}
            self.api.delete_object(
                JOBS, run.ns, run.name, propagation="Background", preconditions=precondition
            )

    def _pod_lost(self, run: _Run, exit_code: int | None) -> None:
        """The pod was deleted under its Job: the Job fails, unless it ended or is going too."""
        job = self.api.read(JOBS, run.ns, run.name)
        if job is None or job["metadata"]["uid"] != run.job["metadata"]["uid"]:
            return
        if job["metadata"].get("deletionTimestamp") or job["status"].get("conditions"):
            return
        self._fail_job(run, *_failure_reason(run.job, run.pod, exit_code, False), final=True)

    async def _deadline(self, run: _Run) -> None:
        reason, message = "DeadlineExceeded", "Job was active longer than specified deadline"
        self._fail_job(run, reason, message, final=False)
        self._terminate(run, 143)
        await asyncio.sleep(self.step_s)
        with contextlib.suppress(kmock.KubernetesError):
            self.api.delete_object(PODS, run.ns, run.pod)
        self._fail_job(run, reason, message, final=True)

    async def _evict(self, run: _Run, reason: str) -> None:
        message = _EVICTION_MESSAGES.get(reason, reason)

        def disrupted(pod: Obj) -> None:
            _set_condition(pod["status"]["conditions"], "DisruptionTarget", True, reason, message)
            if reason == "TerminationByKubelet":
                pod["status"].update(reason="Evicted", message=message)

        self._pod(run, disrupted)
        await asyncio.sleep(self.step_s)
        self._terminate(run, 137)
        self._fail_job(run, *_failure_reason(run.job, run.pod, 137, True), final=True)
        if reason != "TerminationByKubelet":
            await asyncio.sleep(self.step_s)
            with contextlib.suppress(kmock.KubernetesError):
                self.api.delete_object(PODS, run.ns, run.pod)

    def _pod_for(self, job: Obj) -> Obj:
        meta, template = job["metadata"], job["spec"]["template"]
        name, uid = meta["name"], meta["uid"]
        template_meta = template.get("metadata") or {}
        spec = copy.deepcopy(template.get("spec") or {})
        spec.setdefault("schedulerName", "default-scheduler")
        spec.setdefault("serviceAccountName", "default")
        owner = {"apiVersion": "batch/v1", "kind": "Job", "name": name, "uid": uid}
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": f"{name}-"[:58] + _suffix(),  # the API server truncates a generateName
                "namespace": meta["namespace"],
                "labels": {
                    **(template_meta.get("labels") or {}),
                    _JOB_LABELS[0]: uid,
                    _JOB_LABELS[1]: name,
                    "controller-uid": uid,
                    "job-name": name,
                },
                "annotations": {
                    **(template_meta.get("annotations") or {}),
                    "batch.kubernetes.io/job-tracking": "",
                },
                "ownerReferences": [{**owner, "controller": True, "blockOwnerDeletion": True}],
            },
            "spec": spec,
            "status": {"phase": "Pending", "qosClass": _qos(spec)},
        }

    async def close(self) -> None:
        """Stop reacting, end the watches, cancel the driver's tasks; raise what failed in the
        driver's tasks or crashed in the API's handlers (bugs of the fake, or unsupported calls)."""
        if self._on_event in self.api.listeners:
            self.api.listeners.remove(self._on_event)
        self.api.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        # kmock answers a handler's crash with a 500 and keeps it; API errors are intended.
        crashes = [e for e in self.api.errors if not isinstance(e, kmock.KubernetesError)]
        if self.errors or crashes:
            raise BaseExceptionGroup("the fake cluster failed", [*self.errors, *crashes])


def _body_name(body: Obj) -> str:
    meta = body.get("metadata") or {}
    return str(meta.get("name") or meta.get("generateName") or "")


def _node_ready(node: Obj, ready: bool) -> None:
    reason, message = (
        ("KubeletReady", "kubelet is posting ready status")
        if ready
        else ("KubeletNotReady", "container runtime network not ready: NetworkReady=false")
    )
    conditions = node["status"]["conditions"]
    _set_condition(
        conditions, "Ready", ready, reason, message, probe=True, clock="lastHeartbeatTime"
    )
    _set_taint(node, "node.kubernetes.io/not-ready", not ready)


def _node_cordoned(node: Obj, cordoned: bool) -> None:
    if cordoned:
        node["spec"]["unschedulable"] = True
    else:
        node["spec"].pop("unschedulable", None)
    _set_taint(node, "node.kubernetes.io/unschedulable", cordoned)


def _set_taint(node: Obj, key: str, present: bool) -> None:
    taints = [t for t in node["spec"].get("taints") or [] if t["key"] != key]
    if present:
        taints.append({"key": key, "effect": "NoSchedule", "timeAdded": _now()})
    if taints:
        node["spec"]["taints"] = taints
    else:
        node["spec"].pop("taints", None)


@contextlib.asynccontextmanager
async def fake_cluster(
    script: Callable[[Obj], Scenario] | None = None,
    *,
    gc_delay_s: float = 0.1,
    step_s: float = 0.02,
) -> AsyncIterator[FakeCluster]:
    """A fake API server on 127.0.0.1 and its driver; `cluster.url` is the client's host."""
    async with FakeKubeAPI() as api, kmock.Server(api) as server:
        cluster = FakeCluster(
            api, str(server.url).rstrip("/"), script=script, gc_delay_s=gc_delay_s, step_s=step_s
        )
        try:
            yield cluster
        finally:
            await cluster.close()


@pytest_asyncio.fixture
async def fake_kube() -> AsyncIterator[FakeCluster]:
    """A fresh fake cluster per test (import it into a conftest or test module to use it)."""
    async with fake_cluster() as cluster:
        yield cluster
