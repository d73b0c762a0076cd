"""What trainer and server agree on for a shared-memory update: who can open whose memfd, and
the seals that make its size final.

A server reads the trainer's memfd through /proc/<pid>/fd/<fd>: that works only on the same
boot and in the same PID namespace (`shm_host_id`). A reader of a shared mapping that another
process truncates gets SIGBUS, so the memfd must be sealed against shrinking and growing
(`REQUIRED_SEALS`): the trainer adds these seals, the server refuses a memfd without them.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

__all__ = ["REQUIRED_SEALS", "shm_host_id"]

# Linux only (memfd seals); elsewhere 0, and shm_host_id() says "" so "auto" never picks shm.
REQUIRED_SEALS = getattr(fcntl, "F_SEAL_SHRINK", 0) | getattr(fcntl, "F_SEAL_GROW", 0)


def shm_host_id() -> str:
    """Who can open this process's memfds by /proc/<pid>/fd: same boot, same PID namespace.

    "" where there is no such thing (not Linux): it matches no server. Read once per process
    (a process's own PID namespace never changes; a forked child reads it again): every
    same-host update asks.
    """
    global _host_id
    pid = os.getpid()
    if _host_id is None or _host_id[0] != pid:
        _host_id = (pid, _read_host_id())
    return _host_id[1]


_host_id: tuple[int, str] | None = None  # (the pid that read it, the id)


def _read_host_id() -> str:
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        pid_namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return ""
    return f"{boot_id}/{pid_namespace}"
