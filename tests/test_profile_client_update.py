"""bench/profile_client_update.py runs (2 layers, few repeats) and says what it measured: the
flattened state dict exported as one buffer and one span, a tensor each as one of each."""

from __future__ import annotations

import re
from pathlib import Path

from helpers_server import run_script

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "profile_client_update.py"


def test_smoke_run_prints_both_layouts_with_their_buffers_and_spans() -> None:
    out = run_script(SCRIPT, "--layers", "2", "--repeats", "3")
    lines = dict(
        re.findall(
            r"^(flat|per-tensor): (27 tensors, \d+ buffers, \d+ spans): prepare_update [\d.]+ ms, "
            r"export [\d.]+ ms, header and head as messages [\d.]+ ms = [\d.]+ ms$",
            out,
            re.M,
        )
    )
    assert lines == {
        "flat": "27 tensors, 1 buffers, 1 spans",
        "per-tensor": "27 tensors, 27 buffers, 27 spans",
    }, out
