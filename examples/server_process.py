"""Start a local `python -m rollserve.server serve` subprocess for the example trainer.

The server binds port 0 on 127.0.0.1 and writes the port it got to a file, so two runs never
fight over a port. Its output goes to a log file (a pipe nobody reads would fill and block it).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from rollserve.client import RolloutClient


class LocalServer:
    """A server subprocess; use as a context manager so it always stops."""

    def __init__(self, flags: Sequence[str], workdir: Path, *, start_timeout_s: float = 120.0):
        workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = workdir / "server.log"
        port_file = workdir / "server.port"
        port_file.unlink(missing_ok=True)
        command = [sys.executable, "-m", "rollserve.server", "serve", "--host", "127.0.0.1"]
        command += ["--port", "0", "--port-file", str(port_file), *flags]
        with open(self.log_path, "wb") as log:
            self._proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            self.target = f"127.0.0.1:{self._wait_for_port(port_file, start_timeout_s)}"
        except BaseException:
            self.stop()
            raise

    def _wait_for_port(self, port_file: Path, timeout_s: float) -> int:
        deadline_s = time.monotonic() + timeout_s
        while time.monotonic() < deadline_s:
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"rollserve server exited with code {self._proc.returncode} during "
                    f"start-up; log:\n{self.log_path.read_text(errors='replace')}"
                )
            text = port_file.read_text().strip() if port_file.exists() else ""
            if text:
                return int(text)
            time.sleep(0.1)
        raise TimeoutError(f"rollserve server wrote no port within {timeout_s} s")

    def wait_until_ready(self, timeout_s: float = 120.0) -> None:
        with RolloutClient(self.target) as client:
            client.wait_until_ready(timeout_s=timeout_s)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM (graceful drain), then SIGKILL after `timeout_s`."""
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
        try:
            self._proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def __enter__(self) -> LocalServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
