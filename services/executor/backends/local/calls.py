"""What a handler worker asks of a handler and of its reply, in the worker's process (worker.py):
whether it takes a workflow's inputs, and whether a reply is one the executor's parser reads."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from pydantic_core import from_json

from shared import jsonvalue


def takes_inputs(handler: Callable[..., Any]) -> bool:
    """Whether `handler` has a parameter named `inputs` (asked by name: a **kwargs catch-all
    does not count, so a handler never gets an argument it did not name)."""
    try:
        params = inspect.signature(handler).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature
        return False
    return any(
        p.name == "inputs" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in params
    )


def may_be_unreadable(reply: bytes) -> bool:
    """Cheap: whether a reply might hold what pydantic's parser (the executor's) refuses."""
    return b"\\ud" in reply or reply.count(b"[") + reply.count(b"{") > jsonvalue.MAX_DEPTH


def readable(reply: bytes) -> bool:
    try:
        from_json(reply)
    except ValueError:
        return False
    return True
