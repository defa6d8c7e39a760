"""What a task's process gets in its environment: an allowlist of the executor's, and its own
ids; never a deployment secret."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

from services.executor.backends import Launch

# What a task's process gets from the executor's environment: nothing else, so that no
# deployment secret (database URLs, the heartbeat secret, cloud credentials) reaches a task.
TASK_ENV_ALLOW = ("PATH", "HOME", "LANG", "TZ")


def task_base_env(
    passed: Iterable[str] = (), environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The allowlisted part of a task's environment (TASK_ENV_ALLOW plus `passed` names)."""
    source = os.environ if environ is None else environ
    names = [*TASK_ENV_ALLOW, *passed]
    return {n: source[n] for n in names if n in source and not n.upper().startswith("SKED_")}


def task_env(launch: Launch) -> dict[str, str]:
    return {"SKED_TASK_ID": str(launch.task_id), "SKED_ATTEMPT": str(launch.attempt)}


def without_secrets(env: Mapping[str, str]) -> dict[str, str]:
    """The warden's environment: the executor's, less sked's own settings (tasks can read
    /proc/<pid>/environ of processes of their own user)."""
    return {k: v for k, v in env.items() if not k.upper().startswith("SKED_")}
