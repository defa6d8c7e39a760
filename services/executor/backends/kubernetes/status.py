"""How an attempt's Job stands, judged from its Job and pod objects (pure), and what an exit
means.

Kinds, in the order they are checked:
  lost           the Job vanished; its pod was evicted, preempted or otherwise disrupted
  exited         the container terminated with an exit code (0: success)
  launch_failed  it never got to run: permanent (image not found, invalid name, unauthorized,
                 invalid manifest) fails the task at once; otherwise (unschedulable, image pull
                 back-off, no pod) only once the start budget is spent, and the task goes back
                 to Ready without spending a retry
  deadline       the Job's backstop deadline ended it after its container was seen running
  running        the container started (sked's run timer counts from `started_at`)
  pending        none of the above yet
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from services.executor.backends import Key, Outcome, with_declared
from services.executor.backends.kubernetes.manifest import (
    CONTAINER,
    MAX_MESSAGE_BYTES,
    declared_output,
    message_cap,
)

log = logging.getLogger(__name__)

Kind = Literal["pending", "running", "exited", "launch_failed", "lost", "deadline"]

# An image that will never be pulled, however long we wait. Matched against the runtime's
# message with the image's reference taken out (_QUOTED): an image named ".../denied-x" once
# made a registry's i/o timeout permanent. "no such host" is not here: a DNS failure passes.
_NOT_PULLABLE = re.compile(
    r"not found|manifest unknown|unauthorized|denied|repository does not exist|"
    r"invalid reference format",
    re.IGNORECASE,
)
_QUOTED = re.compile(r'"[^"]*"')
_PERMANENT_WAITING = {"InvalidImageName", "ErrImageNeverPull"}
_PULLING = {"ErrImagePull", "ImagePullBackOff"}


@dataclass(frozen=True)
class Verdict:
    kind: Kind
    reason: str = ""
    exit_code: int | None = None
    permanent: bool = False  # launch_failed: fail the task now rather than try again
    started_at: str | None = None  # running / exited: when the container started
    # exited: the container's termination message (a success's declared output); None when
    # no pod's status was seen to say (a Job Complete whose pod is gone, or not seen yet)
    message: str | None = None
    message_cap: int = MAX_MESSAGE_BYTES  # the longest message sure to be whole (message_cap)


def _condition(obj: Mapping[str, Any], kind: str) -> Mapping[str, Any] | None:
    for cond in (obj.get("status") or {}).get("conditions") or []:
        if cond.get("type") == kind and cond.get("status") == "True":
            return dict(cond)
    return None


def _container(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    """The task's container's state: the status named as sked names it, never another's — a
    webhook's sidecar may be listed first (the kubelet sorts them by name)."""
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    for status in statuses:
        if status.get("name") == CONTAINER:
            return dict(status.get("state") or {})
    return {}


def _said(obj: Mapping[str, Any] | None) -> str:
    """'Reason: message' of a condition or container state, as one line."""
    if not obj:
        return ""
    reason, message = obj.get("reason") or "", obj.get("message") or ""
    text = f"{reason}: {message}" if reason and message else reason or message
    return " ".join(str(text).split())[:500]


def latest(pods: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The Job's newest pod (there is one: backoffLimit 0; a second means a replacement)."""
    return max(
        pods,
        key=lambda p: str((p.get("metadata") or {}).get("creationTimestamp") or ""),
        default=None,
    )


def judge(
    job: Mapping[str, Any] | None,
    pods: Sequence[Mapping[str, Any]],
    waited_s: float,
    budget_s: float,
    started: bool = False,
) -> Verdict:
    """The attempt's state from its Job (None: gone) and pods; `waited_s` since the Job was
    created or adopted (a monotonic duration), `budget_s` the start budget; `started`: its
    container was seen running (its pod may be gone since)."""
    if job is None:
        return Verdict("lost", "its Job vanished")
    pod = latest(pods)
    if pod is not None:
        disrupted = _condition(pod, "DisruptionTarget")
        if disrupted is not None:
            return Verdict("lost", f"pod disrupted ({_said(disrupted)})")
        status = pod.get("status") or {}
        if status.get("phase") == "Failed" and status.get("reason") in {"Evicted", "Preempting"}:
            return Verdict("lost", f"pod {_said(status)}")
        state = _container(pod)
        ended = state.get("terminated")
        if ended is not None and ended.get("exitCode") is not None:
            return Verdict(
                "exited",
                _said(ended),
                exit_code=int(ended["exitCode"]),
                started_at=ended.get("startedAt"),
                message=str(ended.get("message") or ""),
                message_cap=message_cap(pod),
            )
        if state.get("running") is not None:
            return Verdict("running", started_at=state["running"].get("startedAt"))
        waiting = state.get("waiting") or {}
        why = waiting.get("reason") or ""
        message = str(waiting.get("message") or "")
        unquoted = _QUOTED.sub('""', message)
        if why in _PERMANENT_WAITING or (why in _PULLING and _NOT_PULLABLE.search(unquoted)):
            return Verdict(
                "launch_failed", f"image cannot be pulled ({_said(waiting)})", permanent=True
            )
    failed = _condition(job, "Failed")
    if failed is not None:
        if failed.get("reason") == "DeadlineExceeded" and started:
            return Verdict("deadline", f"its backstop deadline ran out ({_said(failed)})")
        if failed.get("reason") == "DeadlineExceeded":
            return Verdict(
                "launch_failed", f"deadline before the container started ({_said(failed)})"
            )
        return Verdict("lost", f"Job failed with no exit code ({_said(failed)})")
    if _condition(job, "Complete") is not None:
        return Verdict("exited", "Complete", exit_code=0)
    if waited_s < budget_s:
        return Verdict("pending")
    return Verdict("launch_failed", f"not started within {budget_s:g} s: {_pending_why(pod)}")


def _pending_why(pod: Mapping[str, Any] | None) -> str:
    if pod is None:
        return "no pod was created"
    scheduled = next(
        (
            c
            for c in (pod.get("status") or {}).get("conditions") or []
            if c.get("type") == "PodScheduled" and c.get("status") == "False"
        ),
        None,
    )
    if scheduled is not None:
        return _said(scheduled) or "unschedulable"
    waiting = _container(pod).get("waiting")
    return _said(waiting) or "pod pending"


def exited(verdict: Verdict, tail: str, key: Key) -> Outcome:
    """The outcome of an attempt whose container exited: a success with its declared output
    (its termination message), if any; a failure saying the exit code, and why if Kubernetes
    knows (OOMKilled says what to fix)."""
    code = verdict.exit_code or 0
    if code != 0:
        why = f" ({verdict.reason})" if verdict.reason not in ("", "Error") else ""
        return Outcome(False, {"exit_code": code}, f"exit code {code}{why}", False, False, tail)
    outcome = Outcome(True, {"exit_code": 0}, None, False, False, tail)
    if verdict.message is None:  # its pod is gone (the API said so): nothing to read
        log.warning("%s attempt %d ended with no pod to read its declared output from", *key)
        return outcome
    data, refused = declared_output(verdict.message, verdict.message_cap)
    if refused is not None:
        return Outcome.failed(refused, tail)
    return with_declared(outcome, data, "$SKED_OUTPUT (the termination message)")
