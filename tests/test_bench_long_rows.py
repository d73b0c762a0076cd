"""bench/bench_long_rows.py runs (a smoke run: short rows, one rep) and measures what it says:
its causal lanes attend causally in every layer, its masked lanes never, with the same
numbers."""

from __future__ import annotations

import re
from pathlib import Path

from helpers_server import run_script

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "bench_long_rows.py"


def test_smoke_run_prints_both_routes_with_their_calls_and_equal_numbers() -> None:
    out = run_script(
        SCRIPT, "--hidden", "64", "--layers", "2", "--prompt-len", "4", "8",
        "--response-len", "8", "16", "--reps", "1",
    )  # fmt: skip
    calls = {
        (lane, mode): int(count)
        for lane, mode, count in re.findall(
            r"^\| (scoring|prefill) \| (causal|masked) \| [\d.]+ \| [\d.]+ \| (\d+) \| - \|$",
            out,
            re.M,
        )
    }
    # One forward batch of every row: one causal attention a layer, or none.
    assert calls == {
        ("scoring", "causal"): 2,
        ("scoring", "masked"): 0,
        ("prefill", "causal"): 2,
        ("prefill", "masked"): 0,
    }, out
    for lane in ("scoring", "prefill"):
        found = re.search(rf"^{lane}: masked / causal [\d.]+; largest difference (\S+)$", out, re.M)
        assert found and float(found.group(1)) < 1e-4, out
