"""The order of the tensors in an update file's data section: what both sides agree on.

The client writes the data section in this order (update_file.py) and lays out flattened
weights in it (flat_weights.py); a server on a GPU lays out each model's weights in it
(server/models/memory.py). Where the two meet, an update is one copy (server/weights/copy_runs.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["Entry", "file_order"]

Entry = tuple[str, torch.dtype, tuple[int, ...]]  # a tensor's name, dtype and shape


def file_order(tensors: Sequence[Entry]) -> list[Entry]:
    """The tensors in the order of the update file's data section.

    Wider dtypes first (stable within a width): every tensor then starts at a multiple of its
    itemsize, so a receiver can view its bytes in place (safetensors.torch.save does the same).
    Within a run of neighbours of one module's children (`...self_attn.q_proj.weight`,
    `...self_attn.q_proj.bias`, `...self_attn.k_proj.weight`: the names minus their last two
    parts agree), the weights come before the biases (each kind of last part in the order of
    its first appearance, stable): the projections a GPU server runs as one matmul (q/k/v,
    gate/up: server/generation/fused.py) are then neighbours in the file as in its memory, where
    it lays its weights out in this order (server/models/memory.py), and an update from weights
    flattened in this order (flat_weights.py) is applied as one copy, not one per tensor.
    """
    by_width = sorted(tensors, key=lambda entry: -entry[1].itemsize)
    ordered: list[Entry] = []
    start = 0
    while start < len(by_width):
        width, owner = by_width[start][1].itemsize, _owner(by_width[start][0])
        end = start + 1
        while (
            owner is not None
            and end < len(by_width)
            and by_width[end][1].itemsize == width
            and _owner(by_width[end][0]) == owner
        ):
            end += 1
        kinds: dict[str, int] = {}
        for name, _, _ in by_width[start:end]:
            kinds.setdefault(name.rpartition(".")[2], len(kinds))
        ordered += sorted(by_width[start:end], key=lambda e: kinds[e[0].rpartition(".")[2]])
        start = end
    return ordered


def _owner(name: str) -> str | None:
    """The module whose child holds the tensor `name` (its name minus the last two parts);
    None for a name of fewer than three parts (a tensor of its own)."""
    parts = name.rsplit(".", 2)
    return parts[0] if len(parts) == 3 else None
