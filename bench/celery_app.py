"""The Celery side of bench/race.py: a no-op task (and a `true` subprocess one), and worker-side
signal handlers that record, in memory, when each task started and finished.

Every task carries `(tag, n)`: the batch it belongs to and the batch's size. When the worker has
finished the n-th task of a tag it writes RACE_DIR/<tag>.json (atomically): the time.time() of
the last completion, the failure count and, for latency batches (tag "lat-..."), each task's
start time. So the bench learns when a burst ended from the worker, without polling per task, and
Celery needs no result backend (it keeps no task state at all).

The worker: celery -A bench.celery_app worker --pool threads -c N -O fair, with RACE_BROKER and
RACE_DIR in its environment (bench/race.py starts it). The bench builds its own app with
make_app(broker) and sends by task name.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from celery import Celery, signals

NOOP = "race.noop"
TRUE = "race.true"
QUEUE = "race"


def make_app(broker: str) -> Celery:
    app = Celery("race", broker=broker)
    app.conf.update(
        # what a user who cares about not losing tasks sets: ack after the task ran, so a
        # worker that dies mid-task leaves it in the queue (sked never loses a task either)
        task_acks_late=True,
        # Celery's default multiplier (4): with -c 32 up to 128 unacked messages per worker.
        # Short tasks want a deep prefetch; 1 would make every task wait a broker round trip
        worker_prefetch_multiplier=int(os.environ.get("RACE_PREFETCH", "4")),
        task_ignore_result=True,  # no result backend: Celery keeps no task state
        task_default_queue=QUEUE,
        broker_connection_retry_on_startup=True,
        worker_cancel_long_running_tasks_on_connection_loss=True,
    )

    @app.task(name=NOOP, shared=False)
    def noop(tag: str, n: int) -> None:
        return None

    @app.task(name=TRUE, shared=False)
    def true(tag: str, n: int) -> None:
        subprocess.run(["true"], check=True)

    return app


app = make_app(os.environ.get("RACE_BROKER", "amqp://guest:guest@127.0.0.1:5672//"))

_lock = threading.Lock()
_done: dict[str, int] = {}
_failed: dict[str, int] = {}
_last: dict[str, float] = {}
_starts: dict[str, dict[str, float]] = {}


def _out() -> Path:
    return Path(os.environ.get("RACE_DIR", "."))


def _write(name: str, data: object) -> None:
    tmp = _out() / f".{name}.tmp"
    tmp.write_text(json.dumps(data))
    tmp.rename(_out() / name)


@signals.worker_ready.connect
def _ready(**_: Any) -> None:
    _write("ready.json", {"pid": os.getpid()})


@signals.task_prerun.connect
def _prerun(task_id: str, args: tuple[Any, ...], **_: Any) -> None:
    now = time.time()
    tag = args[0]
    if tag.startswith("lat-"):
        with _lock:
            _starts.setdefault(tag, {})[task_id] = now


@signals.task_postrun.connect
def _postrun(args: tuple[Any, ...], state: str | None = None, **_: Any) -> None:
    now = time.time()
    tag, n = args
    with _lock:
        _done[tag] = _done.get(tag, 0) + 1
        if state != "SUCCESS":
            _failed[tag] = _failed.get(tag, 0) + 1
        _last[tag] = max(_last.get(tag, 0.0), now)
        if _done[tag] != n:
            return
        data = {"last": _last[tag], "count": n, "failed": _failed.get(tag, 0)}
        data["starts"] = _starts.pop(tag, {})
    _write(f"{tag}.json", data)
