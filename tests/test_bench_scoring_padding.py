"""bench/bench_scoring_padding.py runs (a smoke run: a tiny model, one rep) and prints what it
says: the time lanes' ratio and, with --memory, each memory lane's peak and seconds, the causal
route's among them."""

from __future__ import annotations

import re
from pathlib import Path

from helpers_server import run_script

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "bench_scoring_padding.py"


def test_smoke_run_prints_the_time_ratio_and_every_memory_lane() -> None:
    out = run_script(
        SCRIPT, "--memory", "--paths", "hf", "--prompts", "2", "--samples", "1",
        "--prompt-len", "8", "16", "--response-len", "8", "16", "--forward-batch", "2",
        "--hidden", "32", "--layers", "1", "--vocab", "64", "--reps", "1",
    )  # fmt: skip
    assert re.search(r"^path hf: .* ratio plain/sorted\+trimmed = [\d.]+; max \|diff\| ", out, re.M)
    lanes = re.search(
        r"bounded \(.*\) (\d+) MiB / [\d.]+ s, MLP at once (\d+) MiB / [\d.]+ s, mask whole "
        r"(\d+) MiB / [\d.]+ s; .*causal attention \(no mask\) (-?\d+) MiB / [\d.]+ s, "
        r"causal / bounded = ",
        out,
    )
    assert lanes, out
