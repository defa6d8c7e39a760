"""Names a module loads on first use (PEP 562): `shared.store` and `shared.settings` export
theirs this way, so that a process reading one task does not import every aggregate, the
settings model and pydantic."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def exports(module: str, where: Mapping[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` for `module`: each name in `where` is imported from the module
    `where` names for it when first asked for, and kept."""

    def load(name: str) -> Any:
        source = where.get(name)
        if source is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(source), name)
        setattr(sys.modules[module], name, value)
        return value

    return load
