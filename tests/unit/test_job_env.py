"""A handler worker's environment from job to job (worker.JobEnv): each job sees its own
variables, a variable the last job set and this one does not is as it was before any job,
and a variable already at its value is not set again (glibc's setenv keeps every value)."""

from __future__ import annotations

from collections import UserDict

from services.executor.backends.local.worker import JobEnv


class Environ(UserDict[str, str]):
    """A dict that counts the values set in it."""

    def __init__(self, **initial: str) -> None:
        self.sets = 0
        super().__init__(initial)

    def __setitem__(self, key: str, value: str) -> None:
        self.sets += 1
        super().__setitem__(key, value)


def test_each_job_sees_its_own_variables_and_the_rest_as_before() -> None:
    environ = Environ(PATH="/bin", SKED_ATTEMPT="0")
    env = JobEnv(environ)
    first = {"SKED_TASK_ID": "a", "SKED_ATTEMPT": "1", "X": "x"}
    env.use(first)
    assert dict(environ) == {"PATH": "/bin", **first}
    second = {"SKED_TASK_ID": "b", "SKED_ATTEMPT": "1", "PATH": "/usr/bin"}
    environ.sets = 0
    env.use(second)
    assert dict(environ) == second  # X gone again, PATH the job's
    assert environ.sets == 2  # SKED_TASK_ID and PATH: attempt 1 was set already
    env.use({})
    assert dict(environ) == {"PATH": "/bin", "SKED_ATTEMPT": "0"}  # as before any job


def test_a_variable_a_handler_changed_is_set_again() -> None:
    environ = Environ()
    env = JobEnv(environ)
    env.use({"SKED_ATTEMPT": "1"})
    environ["SKED_ATTEMPT"] = "changed by the handler"
    env.use({"SKED_ATTEMPT": "1"})
    assert environ["SKED_ATTEMPT"] == "1"
