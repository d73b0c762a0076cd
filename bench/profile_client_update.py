"""The host side of a cuda_ipc update in the trainer's process, per step, on any machine.

What `client.update_weights(..., transport="cuda_ipc")` does before its one RPC, for a state dict
shaped like the GPU bench's (Qwen2-0.5B: ~290 tensors) flattened into one buffer
(flat_weights.py) or a tensor each: `prepare_update` (checks and the cached layout), the export
(client/weights/cuda_ipc.py: buffers and spans), and the header and head as messages. CPU
tensors stand in for CUDA ones and the calls that need a GPU (the device check, the sync, the
GPU's UUID, torch's `_share_cuda_`) are answered without one, so this measures the Python work
a step costs, not CUDA's. On the H200 (2026-11-27 12:59) the client's part of a 7.1 ms flat
update was 4.2 ms with the RPC; this is the part that is Python.

    python bench/profile_client_update.py            # flat and per-tensor, best of 5 x 200
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from rollserve.client.weights import cuda_ipc
from rollserve.client.weights.flat_weights import flatten_weights
from rollserve.client.weights.update_file import prepare_update
from rollserve.v1 import rollout_pb2 as pb

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers_weights import stand_in_for_cuda  # noqa: E402


def qwen2_shaped(layers: int, hidden: int = 64, kv: int = 16) -> dict[str, torch.Tensor]:
    """A Qwen2 decoder's names and tensor count (small shapes: the costs are per tensor)."""
    shapes = {"model.embed_tokens.weight": (320, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (hidden, hidden), p + "self_attn.q_proj.bias": (hidden,),
            p + "self_attn.k_proj.weight": (kv, hidden), p + "self_attn.k_proj.bias": (kv,),
            p + "self_attn.v_proj.weight": (kv, hidden), p + "self_attn.v_proj.bias": (kv,),
            p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "mlp.gate_proj.weight": (2 * hidden, hidden),
            p + "mlp.up_proj.weight": (2 * hidden, hidden),
            p + "mlp.down_proj.weight": (hidden, 2 * hidden),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        }  # fmt: skip
    shapes |= {"model.norm.weight": (hidden,), "lm_head.weight": (320, hidden)}
    return {name: torch.zeros(shape, dtype=torch.bfloat16) for name, shape in shapes.items()}


def best_ms(step: Callable[[], object], repeats: int, rounds: int = 5) -> float:
    step()
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(repeats):
            step()
        best = min(best, (time.perf_counter() - started) / repeats)
    return best * 1e3


def measure(layout: str, layers: int, repeats: int) -> str:
    """One layout's line: its export's shape and the best ms of each part of a step."""
    weights = qwen2_shaped(layers)
    if layout == "flat":
        flatten_weights(weights)
    exports = cuda_ipc.CudaIpcExports()
    versions = iter(range(1, 1 << 62))
    update = prepare_update(weights, version=0)
    export = cuda_ipc.export_cuda_ipc(update, exports)

    def messages() -> list[bytes]:
        header = pb.WeightsHeader()
        header.CopyFrom(update.header)
        header.cuda_ipc.CopyFrom(export.source)
        return list(update.messages(header, 0, len(update.layout()[0])))

    prepare = best_ms(lambda: prepare_update(weights, version=next(versions)), repeats)
    exporting = best_ms(lambda: cuda_ipc.export_cuda_ipc(update, exports), repeats)
    framing = best_ms(messages, repeats)
    return (
        f"{layout}: {len(weights)} tensors, {len(export.source.buffers)} buffers, "
        f"{len(export.source.spans)} spans: prepare_update {prepare:.3f} ms, export "
        f"{exporting:.3f} ms, header and head as messages {framing:.3f} ms = "
        f"{prepare + exporting + framing:.3f} ms"
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args(argv)
    stand_in_for_cuda(pytest.MonkeyPatch())  # this process only measures; never undone
    for layout in ("flat", "per-tensor"):
        print(measure(layout, args.layers, args.repeats), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
