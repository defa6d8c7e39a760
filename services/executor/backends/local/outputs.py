"""What an attempt leaves to read: its log's tail, and a command's declared output; and its
log file deleted once retention says so."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Set
from pathlib import Path

from services.executor.backends import Key, Outcome, with_declared
from services.executor.backends.local.files import open_regular, remove
from services.executor.backends.local.worker import describe
from shared.jsonvalue import MAX_RESULT_BYTES

log = logging.getLogger(__name__)

# A command's declared output file: twice the result limit, room for a document's indentation.
# Larger is refused unread: it is parsed on the event loop (~25 ms a megabyte), then made
# storable (outcome.storable), which refuses what is over the result limit once compact.
MAX_OUTPUT_BYTES = 2 * MAX_RESULT_BYTES


def tail(path: Path | str, size: int) -> str:
    """The last `size` bytes of a log, as text, from where its data starts if later (a live
    log's head is a hole once cut: logcap); "" for anything but a regular file (a task may
    have put a FIFO in its place, whose open would wait for a writer forever)."""
    try:
        with open_regular(path) as f:
            end = f.seek(0, os.SEEK_END)
            try:
                start = os.lseek(f.fileno(), max(0, end - size), os.SEEK_DATA)
            except OSError:  # ENXIO: nothing but a hole after it
                return ""
            f.seek(start)
            data = f.read(size)
    except OSError:
        return ""
    return data.decode("utf-8", errors="replace")


def with_output(outcome: Outcome, path: Path) -> Outcome:
    """A command that exited 0 and wrote JSON to $SKED_OUTPUT declared that as its output: it
    joins the result (and goes downstream). Output that is not JSON fails the attempt."""
    if not outcome.ok:
        return outcome
    try:
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            data = f.read(MAX_OUTPUT_BYTES + 1) if 0 < size <= MAX_OUTPUT_BYTES else b""
    except FileNotFoundError:
        return outcome  # declared nothing
    except OSError as exc:  # a directory, a FIFO, a symlink in its place
        error = f"declared output in $SKED_OUTPUT cannot be read: {describe(exc)}"
        return Outcome.failed(error, outcome.log_tail)
    if size > MAX_OUTPUT_BYTES or len(data) > MAX_OUTPUT_BYTES:
        size = max(size, len(data))
        error = f"declared output too large: {size} bytes in $SKED_OUTPUT, over {MAX_OUTPUT_BYTES}"
        return Outcome.failed(error, outcome.log_tail)
    return with_declared(outcome, data, "$SKED_OUTPUT")


def prune_logs(directory: Path, older_than_s: float, keep: Set[Key]) -> int:
    """Delete the attempts' log files (`<task>-<attempt>.log`) in `directory` last written
    `older_than_s` ago or longer, but not those of the attempts in `keep` (a silent attempt
    still running). The file times and this clock are this host's: nothing crosses hosts.
    Returns how many were deleted."""
    before = time.time() - older_than_s
    kept = {f"{task_id}-{attempt}.log" for task_id, attempt in keep}
    deleted = 0
    with os.scandir(directory) as entries:
        for entry in entries:
            if not entry.name.endswith(".log") or entry.name in kept:
                continue
            try:
                if entry.stat(follow_symlinks=False).st_mtime < before:
                    remove(entry.path)  # a task may have made its log a directory
                    deleted += 1
            except FileNotFoundError:
                continue  # gone meanwhile
            except OSError as exc:  # one entry's trouble stops no pass
                log.warning("retention: cannot look at %s: %s", entry.path, exc)
    return deleted
