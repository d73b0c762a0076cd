"""bench/profile_gpu.py must not rot between GPU sessions (a session gets minutes of device
time, none to spare on a script that no longer runs): its CPU smoke run exits 0 and prints
every section with its tables filled."""

from __future__ import annotations

import re
from pathlib import Path

from helpers_server import run_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "profile_gpu.py"
# The script's section headers, in print order (its SECTIONS).
SECTIONS = (
    "## Setup",
    "## Copy ceiling",
    "## Decode step",
    "## Sampler alone",
    "## Decode kernels",
    "## Scoring",
    "## Scoring kernels",
    "## New prefill shapes",
    "## Summary",
    "## Scoring body, C++ wrapper",
)


def test_cpu_quick_run_prints_every_section_and_its_tables() -> None:
    out = run_script(SCRIPT, "--device", "cpu", "--quick", "--budget-s", "60")
    lines = "\n" + out  # a header starts a line
    positions = [lines.find(f"\n{title}") for title in SECTIONS]
    assert -1 not in positions, f"missing {SECTIONS[positions.index(-1)]!r} in:\n{out}"
    assert positions == sorted(positions), "sections out of order"
    assert "skipped" not in out and "FAILED" not in out
    # The quick case crosses one width quantum: a decode row per width, with numbers.
    assert re.search(r"^\| 128 \| n/a \| [\d.]+ \|", out, re.M)
    assert re.search(r"^\| 192 \| n/a \| [\d.]+ \|", out, re.M)  # 64-column steps
    # Kernel tables: an eager one per width and one of the scoring call, each with rows.
    assert out.count("| kernel | launches | total ms | ms per call | share |") == 3
    assert len(re.findall(r"^\| aten::mm \|", out, re.M)) == 3
    assert re.search(r"^\| forward\.decode \| [\d.]+ \|", out, re.M)
    assert re.search(r"^\| decoder body \(Forward\.hidden_states\) \| [\d.]+ \|", out, re.M)
    assert re.search(r"^width 192: step [\d.]+ ms", out, re.M)
    # The body under every ROLLSERVE_PREFILL_ATTENTION setting (equal off CUDA: ignored there).
    # Each with the host's time to issue it (a column between the body's ms and the ratio).
    assert re.search(r"^\| efficient \(the default\) \| [\d.]+ \| [\d.]+ \| 1\.00x \|$", out, re.M)
    assert re.search(r"^\| sdpa \| [\d.]+ \| [\d.]+ \| [\d.]+x \|$", out, re.M)
    # ... and with a compiled MLP call per chunk (the call structure before one call a layer).
    chunk = r"^\| efficient, a call per MLP chunk \| [\d.]+ \| [\d.]+ \| [\d.]+x \|$"
    assert re.search(chunk, out, re.M)
    # ... and with every row's prompt its own (no prompt run once for its group).
    assert re.search(
        r"^\| efficient, each row's prompt its own \| [\d.]+ \| [\d.]+ \| [\d.]+x \|$", out, re.M
    )
    # Inductor's C++ wrapper against the default: on CUDA a timed row; the CPU's forward is eager.
    assert re.search(r"^\| Python \(the default\) \| [\d.]+ \| [\d.]+ \| 1\.00x \|$", out, re.M)
    assert re.search(r"^\| C\+\+ \| - \(the forward runs eager here\) \|", out, re.M)
    # The whole step with the shared-prefix attention against the plain one, per width.
    assert re.search(r"^\| 192 \| [\d.]+ \| [\d.]+ \([\d.]+x\) \|$", out, re.M)
    # The shared-prefix variant timed on the request's grouped cache, and agreeing with sdpa.
    table = out[out.index("| matmul_shared ms (KV GB/s) |") :]
    row = re.search(r"^\| 192 \| (.*) \| \w+ \| sdpa \|$", table, re.M)
    assert row and re.fullmatch(r"[\d.]+ \(\d+\)", row.group(1).split(" | ")[-1]), table
    # A new prefill shape's first call against its repeat, three prompt counts (the CPU: SDPA's
    # pick only), and its median in the summary.
    assert len(re.findall(r"^\| sdpa \(its pick\) \| \d+ \| [\d.]+ \| [\d.]+ \|", out, re.M)) == 3
    assert re.search(r"^a new prefill shape, its first call over its repeat", out, re.M)
