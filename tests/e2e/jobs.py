"""Handler functions the end-to-end tests submit (imported by executors as tests.e2e.jobs:NAME)."""

from __future__ import annotations

import time


def add(a: int, b: int) -> int:
    return a + b


def echo(value: object = None) -> object:
    return value


def nap(ms: float = 0) -> float:
    """Sleep `ms` milliseconds; returns when it woke (epoch seconds)."""
    time.sleep(ms / 1000)
    return time.time()


def noop() -> None:
    return None


def nan() -> float:
    return float("nan")


def big(n: int) -> str:
    """A result of about `n` bytes."""
    return "x" * n


def nul() -> str:
    return "a\x00b"
