"""bench/bench_update_latency.py must not rot between GPU sessions (gpu_checks.sh runs it with
--device cuda): its CPU run against a real `rollserve serve` exits 0 and prints both lanes, and
the server's phase lines show the head reused when it repeats and checked when it changes."""

from __future__ import annotations

import re
from pathlib import Path

from helpers_server import run_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "bench_update_latency.py"


def test_cpu_run_prints_both_lanes_and_the_head_is_reused_only_when_it_repeats(
    tmp_path: Path,
) -> None:
    # As on a 16-core GPU node, where the client's default streams are 4 (its grpc lane had
    # come back as "grpc-parallel", and the script stopped at its first lane).
    sixteen_cores = tmp_path / "sixteen_cores.py"
    sixteen_cores.write_text(
        "import os, runpy, sys\n"
        "os.cpu_count = lambda: 16\n"
        f"sys.argv[0] = {str(SCRIPT)!r}\n"
        f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')\n"
    )
    out = run_script(sixteen_cores, "--updates", "2", "--phases", cwd=ROOT)  # 291 tensors, 3.8 MB
    assert re.search(r"Health round trip [\d.]+ ms", out)
    for lane in ("grpc", "shm"):
        assert re.search(
            rf"\| {lane} \| CPU tensors \| [\d.]+ \([\d.]+\) \| [\d.]+ \([\d.]+\) \|", out
        )
    # The at-once table: dist's header and head as one call against a stream of them.
    assert re.search(
        r"\| dist \| CPU tensors \(gloo\) \| [\d.]+ \([\d.]+\) \| [\d.]+ \([\d.]+\) \| [\d.]+ \|",
        out,
    )
    same = re.findall(r"same head, last update: (.*)", out)
    new = re.findall(r"new head, last update: (.*)", out)
    assert len(same) == len(new) == 2
    assert all(" head_check " not in line for line in same)
    assert all(" head_check " in line for line in new)
