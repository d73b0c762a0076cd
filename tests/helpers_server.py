"""Start a real `python -m rollserve.server serve` process on 127.0.0.1 and wait until it serves
(or a RolloutServer in this process: `serve_in_process`).

The server binds port 0 and writes the port it got to a port file; the helper waits for that file
and for grpc.health.v1 to answer SERVING, within a bounded time. Output goes to a log file (a pipe
nobody reads would fill up and block the server) and is shown when start-up fails.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from rollserve.server.config import ServerConfig
from rollserve.server.models import ModelSet
from rollserve.server.serving.app import RolloutServer
from rollserve.server.serving.cli import check_health

__all__ = [
    "ServerProcess",
    "free_port",
    "greedy_snapshot",
    "rss_bytes",
    "run_script",
    "serve_in_process",
    "start_server_process",
]


class ServerProcess(subprocess.Popen):
    """A server subprocess that knows its log file."""

    log_path: Path

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def terminate_and_wait(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, wait up to timeout_s, then SIGKILL; returns the exit code."""
        if self.poll() is None:
            self.send_signal(signal.SIGTERM)
        try:
            return self.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.wait()


def free_port() -> int:
    """A port that was free a moment ago (the OS may hand it out again; good enough for tests)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server_process(
    *args: str,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 90.0,
    prefix: Sequence[str] = (),
) -> tuple[ServerProcess, int]:
    """Run `python -m rollserve.server serve --host 127.0.0.1 --port 0 ... *args`; wait for SERVING.

    `--port 0` is added unless args or env choose a port. Inherited ROLLSERVE_* variables are
    dropped so the caller's environment cannot change what the test starts. `prefix` runs the
    server through another command (e.g. `unshare ...`).
    """
    env = dict(env or {})
    workdir = Path(tempfile.mkdtemp(prefix="rollserve-server-"))
    port_file = workdir / "port"
    command = [*prefix, sys.executable, "-m", "rollserve.server", "serve", "--host", "127.0.0.1"]
    if "--port" not in args and "ROLLSERVE_PORT" not in env:
        command += ["--port", "0"]
    command += ["--port-file", str(port_file), *args]
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLSERVE_")}
    full_env.update(PYTHONUNBUFFERED="1", **env)
    log_path = workdir / "server.log"
    with open(log_path, "wb") as log:
        proc = ServerProcess(command, env=full_env, stdout=log, stderr=subprocess.STDOUT)
    proc.log_path = log_path
    try:
        return proc, _wait_until_serving(proc, port_file, timeout_s)
    except BaseException:
        proc.kill()
        proc.wait()
        sys.stderr.write(f"--- server log ({' '.join(command)}) ---\n{proc.log_text()}\n")
        raise


def _wait_until_serving(proc: ServerProcess, port_file: Path, timeout_s: float) -> int:
    deadline_s = time.monotonic() + timeout_s
    while time.monotonic() < deadline_s:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} during start-up")
        if port_file.exists():
            port = int(port_file.read_text())
            if check_health(f"127.0.0.1:{port}", "", timeout_s=1.0) == "SERVING":
                return port
        time.sleep(0.1)
    raise TimeoutError(f"server did not serve within {timeout_s} s")


def rss_bytes(pid: int) -> int:
    """Resident memory of process `pid` (VmRSS), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for process {pid}")


def greedy_snapshot(target: str, timeout_s: float = 60.0) -> tuple[list[float], int]:
    """Greedy log-probs of a fixed request and the actor's version (Health): equal snapshots
    mean the weights and the version did not change."""
    from rollserve.client import RolloutClient

    with RolloutClient(target, timeout_s=timeout_s) as client:
        experience = client.make_experience(
            [[1, 72, 101, 108], [1, 50, 51]],
            max_new_tokens=6,
            temperature=0.0,
            seed=1,
            rewards=["exact_match"],
            gt_answers=["a", "b"],
        )
        version = client.health().policy_version
    return experience.action_log_probs.flatten().tolist(), version


def serve_in_process(models: ModelSet, **config: object) -> RolloutServer:
    """A started RolloutServer on 127.0.0.1:0 over already loaded models, on the CPU, without a
    metrics port unless `config` names one (test files run in parallel: a fixed port would be
    taken twice); the caller stops it."""
    settings = {"host": "127.0.0.1", "port": 0, "device": "cpu", "log_level": "WARNING",
                "metrics_port": 0, **config}  # fmt: skip
    server = RolloutServer(ServerConfig(**settings), models=models)
    server.start()
    return server


def run_script(script: Path, *args: str, timeout_s: float = 170.0, cwd: Path | None = None) -> str:
    """Run a bench script with this interpreter from the repository root (`cwd`; default: the
    script's folder's parent); its stdout, after asserting it exited 0 (the failure shows the
    ends of both streams)."""
    result = subprocess.run(
        [sys.executable, str(script), *args],
        cwd=cwd or script.resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert result.returncode == 0, (
        f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    )
    return result.stdout
