"""Handlers the benchmarks submit."""


def noop() -> None:
    return None
