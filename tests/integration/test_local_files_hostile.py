"""The local backend's files on a shared host: an attempt's inputs file, planted on by a task of
the executor's user, and the state directory, in reach of every other user of the host
(services/executor/backends/local/statedir.py, files.py)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import stat
import threading
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from uuid import uuid4

import pytest

from services.executor.backends import Launch
from services.executor.backends.local import LocalBackend
from services.executor.backends.local.statedir import UnsafeStateDir
from shared.models import CommandJob
from tests.helpers import loop_stalls

OTHER_UID = 65534  # nobody


@pytest.fixture
async def local(tmp_path: Path) -> AsyncIterator[LocalBackend]:
    b = LocalBackend(2, tmp_path / "state", warm_workers=0)
    await b.start()
    yield b
    await b.close()


async def test_a_fifo_planted_at_the_next_attempt_s_inputs_file_blocks_the_executor_s_loop(
    local: LocalBackend,
) -> None:
    """The inputs file of an attempt is at a predictable path, state_dir/io/<task>-<attempt>
    .inputs.json, in the directory a command learns from its own $SKED_OUTPUT, and the task
    runs as the executor's user. Attempt 1 of a workflow task plants a FIFO where attempt 2's
    inputs file will be, then fails. The local backend wrote the inputs with `Path.write_text`
    on the event loop's thread: open(O_WRONLY) of the FIFO waited for a reader that never
    came, and the executor's whole event loop hung (no lease renewals, outcomes or probes for
    any attempt on the node). Fixed: LocalBackend._attempt writes the inputs with
    statedir.write_inputs, in a thread, which removes whatever is at the path and makes the
    file anew (files.create_new: O_CREAT|O_EXCL|O_NOFOLLOW, the mechanism the declared
    output's log copy uses), so it never opens what the task put there. (A watchdog thread
    plays the reader after 3 s so that a regression fails, not hangs.)"""
    task_id = uuid.uuid4()
    plant = 'd=$(dirname "$SKED_OUTPUT"); mkfifo "$d/${SKED_TASK_ID}-2.inputs.json"; exit 1'
    first = Launch(task_id, 1, CommandJob(argv=["sh", "-c", plant]), None, inputs={"up": 1})
    async with asyncio.timeout(30):
        assert not (await local.run(first)).ok
    fifo = local.state_dir / "io" / f"{task_id}-2.inputs.json"
    assert stat.S_ISFIFO(os.stat(fifo).st_mode), "attempt 1 planted the FIFO"

    rescued = threading.Event()
    done = threading.Event()

    def watchdog() -> None:
        if done.wait(3.0):
            return
        try:
            fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            return
        rescued.set()
        deadline = time.monotonic() + 5
        try:
            while time.monotonic() < deadline and not done.is_set():
                try:
                    if os.read(fd, 1 << 16) == b"" and done.wait(0.05):
                        break
                except BlockingIOError:
                    time.sleep(0.01)
        finally:
            os.close(fd)

    thread = threading.Thread(target=watchdog, daemon=True)
    thread.start()
    second = Launch(task_id, 2, CommandJob(argv=["true"]), 5.0, inputs={"up": 1})
    try:
        async with loop_stalls() as gaps, asyncio.timeout(30):
            await local.run(second)
    finally:
        done.set()
        thread.join(10)
    assert not rescued.is_set(), "the executor's event loop blocked opening the FIFO"
    assert max(gaps, default=0.0) < 1.0, f"the executor's event loop stalled {max(gaps):.1f} s"


async def test_a_task_s_inputs_and_output_files_are_readable_by_every_local_user(
    local: LocalBackend,
) -> None:
    """A workflow task's inputs are its upstreams' outputs — often tokens, customer rows. The
    local backend wrote them to state_dir/io/<task>-<n>.inputs.json with `Path.write_text`
    (0644), in directories made by `Path.mkdir(parents=True)` (0755), under the default state
    dir <tmp>/sked/<node id>: any other user of the host could read every task's inputs (and
    its declared output and log) while it ran. Fixed: LocalBackend.start makes the state dir
    and its subdirectories 0700 (statedir.make_private, which also sets an existing one of
    this user's back to 0700), and the inputs file is made 0600 (statedir.write_inputs)."""
    probe = (
        'printf \'{"file": "%s", "dir": "%s", "state": "%s"}\' '
        '"$(stat -c %a "$SKED_INPUTS")" "$(stat -c %a "$(dirname "$SKED_INPUTS")")" '
        '"$(stat -c %a "$(dirname "$(dirname "$SKED_INPUTS")")")" > "$SKED_OUTPUT"'
    )
    what = Launch(
        uuid4(), 1, CommandJob(argv=["sh", "-c", probe]), 10.0, inputs={"db": {"token": "s3"}}
    )
    async with asyncio.timeout(30):
        outcome = await local.run(what)
    assert outcome.ok, outcome
    modes = {k: int(v, 8) for k, v in outcome.result["output"].items()}
    others = {k: oct(m) for k, m in modes.items() if m & 0o004}
    assert not others, f"readable by every user of the host: {others}"


async def test_every_state_directory_is_the_executor_s_own(local: LocalBackend) -> None:
    """The state dir and each directory in it are 0700: the logs, the workers' output files,
    the attempts' inputs and outputs, the records of what runs, the lock."""
    root = local.state_dir
    for path in (root, *(p for p in root.iterdir() if p.is_dir())):
        assert stat.S_IMODE(os.lstat(path).st_mode) == 0o700, (path, oct(os.lstat(path).st_mode))
    assert {p.name for p in root.iterdir() if p.is_dir()} == {"logs", "workers", "io", "running"}
    assert stat.S_IMODE(os.lstat(root / "lock").st_mode) & 0o077 == 0


async def test_a_symlink_planted_at_the_inputs_path_is_not_written_through(
    local: LocalBackend, tmp_path: Path
) -> None:
    """A task plants a symlink where its retry's inputs file will be, to a file of the
    executor's user elsewhere: the inputs are written to a file made anew at the path; the
    symlink's target is left as it was."""
    victim = tmp_path / "victim"
    victim.write_text("precious")
    task_id = uuid4()
    plant = f'd=$(dirname "$SKED_OUTPUT"); ln -s {victim} "$d/${{SKED_TASK_ID}}-2.inputs.json"'
    first = Launch(task_id, 1, CommandJob(argv=["sh", "-c", plant + "; exit 1"]), 10.0, inputs={})
    async with asyncio.timeout(30):
        assert not (await local.run(first)).ok
    assert (local.state_dir / "io" / f"{task_id}-2.inputs.json").is_symlink()
    read = 'test -L "$SKED_INPUTS" && exit 3; cat "$SKED_INPUTS" > "$SKED_OUTPUT"'
    second = Launch(task_id, 2, CommandJob(argv=["sh", "-c", read]), 10.0, inputs={"up": 7})
    async with asyncio.timeout(30):
        outcome = await local.run(second)
    assert outcome.ok, outcome
    assert outcome.result["output"] == {"up": 7}
    assert victim.read_text() == "precious"


async def test_large_inputs_arrive_whole(local: LocalBackend) -> None:
    """Inputs of megabytes (a workflow allows 8 MiB) are written off the event loop, whole."""
    inputs = {"rows": ["x" * 1000] * 4000}  # ~4 MB of JSON
    digest = 'printf \'"%s"\' "$(sha256sum < "$SKED_INPUTS" | cut -c1-64)" > "$SKED_OUTPUT"'
    what = Launch(uuid4(), 1, CommandJob(argv=["sh", "-c", digest]), 30.0, inputs=inputs)
    async with asyncio.timeout(60):
        outcome = await local.run(what)
    assert outcome.ok, outcome
    assert outcome.result["output"] == hashlib.sha256(json.dumps(inputs).encode()).hexdigest()


async def test_an_existing_state_dir_open_to_others_is_made_private(tmp_path: Path) -> None:
    """A state dir of this user's left 0755 (or 0777) by an earlier version is set to 0700, its
    subdirectories too, at start; what it holds is kept."""
    state = tmp_path / "state"
    (state / "logs").mkdir(parents=True)
    (state / "logs" / "old-1.log").write_text("kept")
    os.chmod(state, 0o755)
    os.chmod(state / "logs", 0o777)
    b = LocalBackend(1, state, warm_workers=0)
    await b.start()
    try:
        for path in (state, state / "logs", state / "io"):
            assert stat.S_IMODE(os.lstat(path).st_mode) == 0o700, path
        assert (state / "logs" / "old-1.log").read_text() == "kept"
    finally:
        await b.close()


async def start_refused(state: Path) -> str:
    b = LocalBackend(1, state, warm_workers=0)
    try:
        with pytest.raises(UnsafeStateDir) as refused:
            await b.start()
    finally:
        await b.close()
    return str(refused.value)


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory away takes root")


@needs_root
async def test_a_state_dir_another_user_made_first_is_refused(tmp_path: Path) -> None:
    """<tmp>/sked/<node id> is predictable: another user who makes it first would own the
    directory the executor writes every task's inputs into. start() refuses it, naming it."""
    state = tmp_path / "state"
    state.mkdir(mode=0o777)
    os.chown(state, OTHER_UID, OTHER_UID)
    message = await start_refused(state)
    assert str(state) in message, message
    assert f"uid {OTHER_UID}" in message, message
    assert not (state / "io").exists()


@needs_root
async def test_a_subdirectory_another_user_made_is_refused(tmp_path: Path) -> None:
    state = tmp_path / "state"
    (state / "io").mkdir(parents=True)
    os.chown(state / "io", OTHER_UID, OTHER_UID)
    message = await start_refused(state)
    assert str(state / "io") in message, message


@needs_root
async def test_a_state_dir_under_another_user_s_directory_is_refused(tmp_path: Path) -> None:
    """Another user who owns /tmp/sked may rename this node's directory in it and put one of
    their own in its place: a directory above the state dir must be root's or this user's."""
    theirs = tmp_path / "sked"
    theirs.mkdir()
    os.chown(theirs, OTHER_UID, OTHER_UID)
    message = await start_refused(theirs / "node")
    assert str(theirs) in message, message


async def test_a_state_dir_under_a_directory_anyone_may_write_is_refused(tmp_path: Path) -> None:
    """World-writable and not sticky: anyone may rename the state dir away and replace it."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    message = await start_refused(shared / "node")
    assert str(shared) in message, message
    assert "0o777" in message, message
    os.chmod(shared, 0o1777)  # sticky, as /tmp is: only the owner may rename an entry
    b = LocalBackend(1, shared / "node", warm_workers=0)
    await b.start()
    await b.close()


async def test_a_symlinked_state_dir_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "state"
    link.symlink_to(real)
    message = await start_refused(link)
    assert str(link) in message, message
    assert "symlink" in message, message


async def test_a_file_in_a_state_subdirectory_s_place_is_refused(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / "logs").write_text("")
    message = await start_refused(state)
    assert str(state / "logs") in message, message
    assert "not a directory" in message, message
