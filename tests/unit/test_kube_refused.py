"""A refusal of the executor's Kubernetes credentials (401/403) is said as an error naming the
fix, once a minute per call, and retried slowly until granted; an outage stays a warning."""

from __future__ import annotations

import asyncio
import logging

import pytest

from services.executor.backends.kubernetes import kube
from services.executor.backends.kubernetes.kube import KubeError, patiently

FORBIDDEN = '{"kind": "Status", "message": "jobs.batch \\"x\\" is forbidden: User cannot get"}'


async def test_a_forbidden_call_is_an_error_naming_rbac_and_is_retried_until_granted(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    slept: list[float] = []

    async def no_wait(s: float) -> None:
        slept.append(s)

    monkeypatch.setattr(kube.asyncio, "sleep", no_wait)
    answers: list[object] = [KubeError(403, FORBIDDEN)] * 13 + [KubeError(503, "busy"), "job"]

    async def call() -> object:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    with caplog.at_level(logging.WARNING):
        assert await asyncio.wait_for(patiently(call, "get job x"), 5) == "job"
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(errors) == 2  # the first refusal, and the 13th (a minute on)
    assert errors[0].startswith("get job x: KubeError: HTTP 403: jobs.batch")
    assert "deploy/kubernetes/rbac.yaml" in errors[0]
    assert warnings == ["get job x: KubeError: HTTP 503: busy; trying again in 0.2 s"]
    assert slept == [kube.REFUSED_PAUSE_S] * 13 + [0.2]
