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
    # call, with or without shared prompts (the prompts' tokens run once, with the rest's in
    # one row of tokens: 8 x 2 + 64 x 4); a call per chunk: one q/k/v call and an MLP call
    # per chunk (6 of 384 tokens, 5 of 272).
    assert calls == {
        ("default", "each row's own"): 4,
        ("default", "run once a group"): 4,
        ("a call per chunk", "each row's own"): 14,
        ("a call per chunk", "run once a group"): 12,
    }, out
    assert re.search(r"^default / a call per chunk \(own prompts\): [\d.]+$", out, re.M), out
    assert re.search(r"^default / a call per chunk \(shared prompts\): [\d.]+$", out, re.M), out
