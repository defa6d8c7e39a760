"""The small policy modules (shared.policy, shared.execlimits) against a hostile producer: a
job that would slip past the command allowlist through its own environment, or that no exec
could ever start."""

from __future__ import annotations

import pytest

from shared.errors import InvalidSettings, InvalidSpec
from shared.models import CommandJob, TaskSpec
from shared.policy import JobPolicy
from shared.settings import Settings


@pytest.mark.parametrize(
    ("allowed", "argv", "env"),
    [
        # bash expands BASH_ENV (command substitution included) before any script line runs
        (("/opt/jobs/",), ["/opt/jobs/build.sh"], {"BASH_ENV": "$(sh -c 'id > /tmp/pwned')"}),
        # an exported bash function replaces whatever command the allowed script calls
        (("/opt/jobs/",), ["/opt/jobs/build.sh"], {"BASH_FUNC_echo%%": "() { sh -i; }"}),
        # the dynamic loader runs the named library's code inside the allowed program
        (("/usr/bin/rsync",), ["/usr/bin/rsync", "-a", "x", "y"], {"LD_PRELOAD": "/tmp/x.so"}),
        # an allowed bare program name is looked up in the PATH the task itself chose
        (("rsync",), ["rsync", "-a", "x", "y"], {"PATH": "/tmp/attacker-bin"}),
    ],
    ids=["BASH_ENV", "BASH_FUNC", "LD_PRELOAD", "PATH"],
)
def test_command_allowlist_is_bypassed_through_the_jobs_own_environment(
    allowed: tuple[str, ...], argv: list[str], env: dict[str, str]
) -> None:
    """With SKED_ALLOWED_COMMANDS set, a job names an allowed program but sets, in its own
    `env`, a variable that makes the program run other code (checked by hand:
    `env -i BASH_ENV='$(id > f)' /opt/jobs/build.sh` writes f before the script's first line;
    `BASH_FUNC_echo%%=() { id; }` runs id for the script's echo). JobPolicy.refuses looked at
    argv[0] only and let it through. Now a job setting such a variable is refused, naming it."""
    policy = JobPolicy.of([], allowed)
    job = CommandJob(argv=argv, env=env)
    assert policy.refuses(job) is not None


@pytest.mark.parametrize("name", ["K=V", ""], ids=["equals-sign", "empty"])
def test_an_env_name_execve_cannot_take_is_accepted_at_submission(name: str) -> None:
    """A command job whose env holds a variable named "K=V" (or "") is submitted. No exec can
    ever take it (Python's os.execve raises "ValueError: illegal environment variable name" in
    the shim's leader, on every attempt; the kernel has no way to express it), so it is owed a
    clear refusal at intake, as CommandJob._startable / shared.execlimits give a too-large
    environment ("judged without running anything"). It was accepted, and each attempt failed
    at launch, retries spent on a task that can never start. Now it is refused at intake."""
    spec = {"name": "n", "job": {"kind": "command", "argv": ["/bin/true"], "env": {name: "x"}}}
    with pytest.raises(InvalidSpec):
        TaskSpec.parse(spec)


def test_a_bare_program_name_in_the_command_allowlist_is_refused_at_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SKED_ALLOWED_COMMANDS=rsync would allow whatever program named rsync the job's PATH
    finds first. Such an entry is refused when the settings are read, naming the setting."""
    monkeypatch.setenv("SKED_ALLOWED_COMMANDS", "/usr/bin/tar,rsync")
    with pytest.raises(InvalidSettings, match="SKED_ALLOWED_COMMANDS"):
        Settings()
    monkeypatch.setenv("SKED_ALLOWED_COMMANDS", "/usr/bin/tar,/opt/jobs/")
    assert Settings().allowed_commands == ["/usr/bin/tar", "/opt/jobs/"]


def test_a_job_without_code_variables_is_still_allowed() -> None:
    """The check names variables, it does not refuse every environment: an allowed program
    with ordinary variables runs."""
    policy = JobPolicy.of([], ("/opt/jobs/",))
    job = CommandJob(argv=["/opt/jobs/build.sh"], env={"MODE": "fast", "LANG": "C.UTF-8"})
    assert policy.refuses(job) is None


@pytest.mark.parametrize("name", ["PYTHONUNBUFFERED", "PYTHONIOENCODING", "GIT_AUTHOR_NAME"])
def test_variables_that_run_nothing_are_not_refused(name: str) -> None:
    """The list names what runs code: a Python job's PYTHONUNBUFFERED, or git's author, is
    not refused with it."""
    policy = JobPolicy.of([], ("/opt/jobs/",))
    assert policy.refuses(CommandJob(argv=["/opt/jobs/run"], env={name: "1"})) is None
