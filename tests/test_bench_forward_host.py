"""bench/bench_forward_host.py runs (a smoke run: 2 layers, few reps) and measures what it says:
the default makes one compiled MLP call a layer where the baseline makes one per chunk."""

from __future__ import annotations

import re
from pathlib import Path

from helpers_server import run_script

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "bench_forward_host.py"


def test_smoke_run_prints_both_lanes_and_their_compiled_calls() -> None:
    out = run_script(SCRIPT, "--layers", "2", "--reps", "2", "--warm-reps", "1")
    calls = {
        (lane, prompts): int(count)
        for lane, prompts, count in re.findall(
            r"^\| (default|a call per chunk) \| ([^|]+?) \| [\d.]+ \| [\d.]+ \| (\d+) \|$",
            out,
            re.M,
        )
    }
    # Per layer, 64 x 6 tokens in MLP chunks of 64: the default one q/k/v call and one MLP
    # call (two of each with shared prompts: the prompts', the rest's); a call per chunk: one
    # q/k/v call and 6 MLP calls (the prompts' 1 + 1, the rest's 1 + 4).
    assert calls == {
        ("default", "each row's own"): 4,
        ("default", "run once a group"): 8,
        ("a call per chunk", "each row's own"): 14,
        ("a call per chunk", "run once a group"): 14,
    }, out
    assert re.search(r"^default / a call per chunk \(own prompts\): [\d.]+$", out, re.M), out
    assert re.search(r"^default / a call per chunk \(shared prompts\): [\d.]+$", out, re.M), out
