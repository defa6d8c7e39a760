"""The warden: a small process per executor that starts attempts and holds their leases.

`python -m services.executor.warden FD` — FD is a Unix stream socket to the
executor. Each request (a length-prefixed JSON spawn request, with file descriptors
attached) goes to a *shim*, an idle one if there is one, else one the warden forks: the
supervisor of one process tree at a time, which

- starts the attempt's process (its own process group, SIGKILLed if the shim dies) and is a
  child subreaper, so whatever the process starts — daemons that call setsid included — stays
  below it and is found and killed when the attempt ends;
- keeps the attempt's lease: the executor writes `renew SECONDS` each time Postgres has
  renewed the lease; if none arrives in time, the shim freezes the whole tree (SIGSTOP) on
  its own, without the executor (which may be frozen, partitioned or dead). `renew` with
  time left thaws it (one with none — a renewal applied after the executor woke from a
  freeze — leaves it frozen: a successor may run by now); `kill` (the attempt was
  superseded), the executor's death, or staying frozen past `freeze_max_s` kills it, and so
  does `stop` while it is frozen (only `renew` thaws);
- reports to the executor on a pipe: `pid N START SHIM` (the leader's own line, before it
  execs the program), `error TEXT` (its exec failed), `frozen`, `thawed`, `exit STATUS HOW`;
- once the tree is gone to its last process, tells the warden it is idle and waits for the
  next attempt (a shim some of whose tree would not die exits instead, leaving the rest to
  the warden).

Only the standard library, and fork rather than exec: a shim costs a fork of this small
process, not a Python start, and is kept for the next attempt rather than forked again. Why
our own: no library supervises a process tree with a lease that must hold while its parent
is frozen; see docs/architecture.md for the timing argument.
"""
