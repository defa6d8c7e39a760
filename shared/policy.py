"""Which jobs a deployment runs at all (pure): an optional allowlist of handler modules and
command programs. Whoever can publish to `sked.tasks` can run code on the executors; these
lists narrow what that code may be (README, "Trust model"). Empty lists allow everything.

Where the command list narrows what runs, a job's own environment may not name a variable that
makes an allowed program run code the job chose without any file planted: the dynamic
loader's (`LD_PRELOAD`), a shell's start-up file and exported functions (`BASH_ENV`,
`BASH_FUNC_f%%`), interpreters' options and paths, and the `PATH` an allowed script's own
commands are found by. (A list of names, not a parser of each program's options: an operator
who allows a program that reads code from some other variable must know it.)
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable
from dataclasses import dataclass

from shared.models import CommandJob, HandlerJob

CODE_VARS = frozenset(
    {
        *("PATH", "IFS", "ENV", "BASH_ENV", "SHELLOPTS", "BASHOPTS", "PS4", "PROMPT_COMMAND"),
        *("GCONV_PATH", "LOCPATH", "NLSPATH", "HOSTALIASES", "RESOLV_HOST_CONF", "MALLOC_TRACE"),
        *("JAVA_TOOL_OPTIONS", "_JAVA_OPTIONS", "JDK_JAVA_OPTIONS", "CLASSPATH"),
        *("NODE_OPTIONS", "NODE_PATH", "RUBYOPT", "RUBYLIB", "PERL5OPT", "PERL5LIB", "PERLLIB"),
        *("LUA_INIT", "LUA_PATH", "LUA_CPATH", "TCLLIBPATH"),
        # commands that git, ssh, less, man and editors run from a variable
        *("GIT_SSH", "GIT_SSH_COMMAND", "GIT_EXEC_PATH", "GIT_EXTERNAL_DIFF", "GIT_PAGER"),
        *("GIT_PROXY_COMMAND", "GIT_ASKPASS", "GIT_EDITOR", "GIT_SEQUENCE_EDITOR"),
        *("GIT_TEMPLATE_DIR", "SSH_ASKPASS", "EDITOR", "VISUAL", "PAGER", "MANPAGER"),
        *("LESSOPEN", "LESSCLOSE", "VIMINIT", "EXINIT", "BROWSER"),
    }
)
CODE_PREFIXES = ("LD_", "BASH_FUNC_", "PYTHON", "DYLD_", "LUA_INIT_", "GIT_CONFIG")
# of the prefixes' names, those that run nothing: common in Python jobs, refused for nothing
HARMLESS = frozenset(
    {
        *("PYTHONUNBUFFERED", "PYTHONIOENCODING", "PYTHONDONTWRITEBYTECODE", "PYTHONHASHSEED"),
        *("PYTHONUTF8", "PYTHONFAULTHANDLER", "PYTHONOPTIMIZE"),  # (-W imports a module)
    }
)


def runs_code(name: str) -> bool:
    """Whether an environment variable so named may make a program run code it names."""
    return name not in HARMLESS and (name in CODE_VARS or name.startswith(CODE_PREFIXES))


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
        code = sorted(k for k in job.env if runs_code(k))
        if code:
            return (
                f"environment variable {code[0]} is not allowed here: it could make an allowed "
                "program run other code (SKED_ALLOWED_COMMANDS narrows what runs)"
            )
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
