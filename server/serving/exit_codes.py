"""The exit codes of `rollserve serve`: one table for the stop (app.py), the command's --help
(cli.py) and the README. Light on purpose: the CLI imports it before any heavy module.

A stop (SIGTERM or SIGINT) reports NOT_SERVING, waits --drain-delay-s, refuses new calls and gives
the calls in flight --shutdown-grace-s; then it cancels what still runs and gives the cancelled
handlers and the engine STOP_BOUND_S more. Whatever they are doing (waiting on a peer, sending to
a client that does not read, a long batch on the engine), the process ends by
drain delay + grace + STOP_BOUND_S and a little: work still running then is left behind
(os._exit), which waiting for it would not be (a pool thread holds the interpreter's exit; the
engine thread inside a torch op aborts it).
"""

from __future__ import annotations

import enum
import textwrap

__all__ = ["STOP_BOUND_S", "ExitCode", "exit_codes_help"]

# After --shutdown-grace-s: how long cancelled handlers and the engine's batch in progress get to
# end before the process leaves without them.
STOP_BOUND_S = 5.0


class ExitCode(enum.IntEnum):
    """What the process's exit status says about how it ended."""

    DRAINED = 0  # stopped after every call in flight finished within --shutdown-grace-s
    START_FAILED = 1  # a model, the address, TLS or token files, or the readiness check
    USAGE = 2  # a bad flag or value (argparse's status)
    CANCELLED = 3  # calls still running when the grace ended were cancelled, then all stopped
    ABANDONED = 4  # work that did not end within STOP_BOUND_S after the grace was left behind


_MEANINGS = {
    ExitCode.DRAINED: "stopped after every call in flight finished within --shutdown-grace-s",
    ExitCode.START_FAILED: "could not start (models, address, TLS or token files, readiness)",
    ExitCode.USAGE: "a bad flag or value",
    ExitCode.CANCELLED: (
        "stopped; calls still running when --shutdown-grace-s ended were cancelled (their "
        "clients got a status) and every handler and the engine then stopped"
    ),
    ExitCode.ABANDONED: (
        f"stopped without waiting for work that had not ended {STOP_BOUND_S:g} s after the "
        "grace (a handler stuck on a peer, the engine inside a batch, a weights-group "
        "rendezvous inside torch)"
    ),
}


def exit_codes_help() -> str:
    """The exit-code table of `rollserve serve --help`."""
    lines = ["exit codes:"]
    for code in ExitCode:
        lines += textwrap.wrap(
            _MEANINGS[code], width=79, initial_indent=f"  {int(code)}  ", subsequent_indent="     "
        )
    return "\n".join(lines)
