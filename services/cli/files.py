"""A workflow file as the CLI reads it (`sked submit-workflow FILE`): a regular file of bounded
size, YAML or JSON, whose values are counted before pydantic walks them."""

from __future__ import annotations

import os
import stat
from typing import Any

from shared.errors import SkedError

# Values a workflow file may expand to. A message of at most SKED_MAX_MESSAGE_BYTES holds far
# fewer (each value takes two bytes or more), but YAML's aliases repeat a node without its
# bytes: nine levels of nine aliases are 43 million values, and validating them took 18 s and
# 800 MB before the spec was refused anyway.
MAX_FILE_VALUES = 1_000_000
MAX_FILE_BYTES = 4 * 1024 * 1024  # a workflow file: a few messages' worth


def load_workflow(path: str) -> Any:
    import yaml  # YAML is a superset of JSON: one loader reads both

    try:
        # a regular file, opened without waiting (a FIFO would wait for a writer forever),
        # and no larger than a few messages: PyYAML reads ~100 KB a second in Python
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            found = os.fstat(fd)
            if not stat.S_ISREG(found.st_mode):
                raise SkedError(f"{path} is not a regular file")
            if found.st_size > MAX_FILE_BYTES:
                raise SkedError(f"{path} is {found.st_size:,} bytes: over {MAX_FILE_BYTES:,}")
            text = f.read(MAX_FILE_BYTES + 1).decode("utf-8")
    except OSError as exc:
        raise SkedError(f"cannot read {path}: {exc}") from None
    except UnicodeDecodeError as exc:
        raise SkedError(f"{path} is not UTF-8 text: {exc}") from None
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    try:
        loaded = yaml.load(text, Loader=loader)
    except yaml.YAMLError as exc:
        raise SkedError(f"{path} is not YAML or JSON: {exc}") from None
    except RecursionError:
        raise SkedError(f"{path} is nested too deep") from None
    todo, seen = [loaded], 0
    while todo:  # counted as pydantic would walk it, aliases repeated; stops at the limit
        item = todo.pop()
        seen += 1
        if seen > MAX_FILE_VALUES:
            raise SkedError(f"{path} expands to over {MAX_FILE_VALUES:,} values (YAML aliases?)")
        if isinstance(item, dict):
            todo.extend(item.values())
        elif isinstance(item, list):
            todo.extend(item)
    return loaded
