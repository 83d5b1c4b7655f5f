"""Child processes that die with the process that started them (Linux), whatever kills that parent.

`sluice up` and the tests start Redis and the services as children. If the supervisor is killed
(SIGKILL, OOM killer, a closed terminal), nothing would stop those children: the services run in
their own session (so that a terminal's Ctrl-C reaches only the supervisor, which stops them in order)
and `redis-server` would keep its port forever. So every child is started through `lifeline_command`:
a tiny trampoline asks Linux for SIGTERM when its parent dies (`prctl(PR_SET_PDEATHSIG)`, which
survives exec), checks the parent is still there, then execs the real program under the same pid.

Why a trampoline and not `preexec_fn`: forking a multi-threaded process (gRPC, torch) and running
Python between fork and exec can deadlock. Limits: Linux only (elsewhere the command simply runs,
unprotected); the signal fires when the *thread* that spawned the child exits, so spawn from a thread
that lives as long as the supervisor (the main thread, as Stack does).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

__all__ = ["lifeline_command"]

_TRAMPOLINE = """
import contextlib, ctypes, os, signal, sys
with contextlib.suppress(Exception):
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[1]):
    sys.exit(1)  # the parent is already gone
os.execv(sys.argv[2], sys.argv[2:])
"""


def lifeline_command(argv: Sequence[str]) -> list[str]:
    """Return a command line that runs `argv` (argv[0] an executable path) and gets SIGTERM when this process dies.

    The program keeps the pid of the returned command (exec, no extra process). Raises ValueError for an
    empty argv.
    """
    if not argv:
        raise ValueError("lifeline_command needs a program to run")
    # -I -S: the trampoline needs only the standard library; skipping site and the environment saves start time.
    return [sys.executable, "-I", "-S", "-c", _TRAMPOLINE, str(os.getpid()), *argv]
