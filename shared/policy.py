"""Which jobs a deployment runs at all (pure): an optional allowlist of handler modules and
command programs. Whoever can publish to `sked.tasks` can run code on the executors; these
lists narrow what that code may be (README, "Trust model"). Empty lists allow everything.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable
from dataclasses import dataclass

from shared.models import CommandJob, HandlerJob


@dataclass(frozen=True)
class JobPolicy:
    # module prefixes: "myapp" allows myapp:f and myapp.jobs:f, not myapp2:f
    handlers: tuple[str, ...] = ()
    # programs: "/usr/bin/rsync" exactly, or a directory ending in "/" for every program in it
    commands: tuple[str, ...] = ()

    @classmethod
    def of(cls, handlers: Iterable[str], commands: Iterable[str]) -> JobPolicy:
        return cls(tuple(h.strip() for h in handlers if h.strip()), tuple(commands))

    def refuses(self, job: CommandJob | HandlerJob) -> str | None:
        """Why this deployment does not run `job`; None if it does."""
        if isinstance(job, HandlerJob):
            if not self.handlers:
                return None
            module = job.handler.rpartition(":" if ":" in job.handler else ".")[0]
            if any(module == p or module.startswith(p + ".") for p in self.handlers):
                return None
            return (
                f"handler {job.handler} is not allowed here (allowed: {', '.join(self.handlers)})"
            )
        if not self.commands:
            return None
        program = job.argv[0]
        # a directory allows the programs below it by their path's prefix, so only a path
        # already normal is judged by it: "/opt/jobs/../../bin/sh" starts with "/opt/jobs/"
        normal = program.startswith("/") and posixpath.normpath(program) == program
        if any(
            program == p or (normal and p.endswith("/") and program.startswith(p))
            for p in self.commands
        ):
            return None
        return f"command {program!r} is not allowed here (allowed: {', '.join(self.commands)})"
