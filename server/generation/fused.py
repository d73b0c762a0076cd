"""Projections that read the same input as one matmul: q/k/v, and the MLP's gate/up.

A decode step of 512 rows runs each layer's k and v projections as GEMMs of 128 output
features (two of the layer's smallest kernels, ~0.2 ms of a 3.7 ms step on an H100,
bench/RESULTS.md), and gate and up as two GEMMs over the same normed input. One GEMM over the
concatenated weights gives the same outputs with fewer launches and better-shaped tiles.

The weights stay the HF module's: the engine's own forward and the HF forward must see one set
of weights (UpdateWeights, LoRA merges and scoring write and read the modules' parameters).
So the concatenated tensor is the storage, and each module's weight (and bias) becomes a view
of its block of rows (`param.data = block`): the same Parameter objects, the same values, no
second copy. Writes into a parameter (every update on a device copies into the existing
storage) land in the fused tensor the engine's GEMMs and CUDA graphs read.

A parameter rebound to other memory (`param.data = other`: the CPU adoption of a staged update,
weights/arena.py) no longer writes through. `refresh` finds such a part (by address) and copies
its values back into its block, then points it there again: the fused tensor keeps its address,
so graphs captured on it stay valid. Parts moved to another device or dtype (`model.to`) get a
new fused tensor.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from .switches import cuda_switch

__all__ = ["FUSE_ENV", "FusedProjection", "fuse", "fuses_by_default"]

FUSE_ENV = "ROLLSERVE_FUSED_PROJECTIONS"  # "0": one GEMM per projection, as the HF module has

# (weight, bias) as F.linear takes them.
Linear = tuple[torch.Tensor, torch.Tensor | None]


def fuses_by_default(device: torch.device) -> bool:
    """Whether the engine fuses its projections on `device`: ROLLSERVE_FUSED_PROJECTIONS "0"
    or "1" says so; unset, on CUDA only (launches and GEMM shapes matter there; on the CPU a
    full update adopts the staged tensors by rebinding, which `refresh` then copies back)."""
    return cuda_switch(FUSE_ENV, device)


def _joined(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The tensor whose row blocks `tensors` already are (back to back in one storage,
    contiguous, one dtype and device), as a view; None when they are not."""
    first = tensors[0]
    storage = first.untyped_storage().data_ptr()
    expected = first.data_ptr()
    for tensor in tensors:
        if (
            not tensor.is_contiguous()
            or tensor.dtype != first.dtype
            or tensor.device != first.device
            or tensor.shape[1:] != first.shape[1:]
            or tensor.untyped_storage().data_ptr() != storage
            or tensor.data_ptr() != expected
        ):
            return None
        expected += tensor.numel() * tensor.element_size()
    rows = sum(t.shape[0] for t in tensors)
    joined = first.detach().new_empty(0)
    return joined.set_(first.untyped_storage(), first.storage_offset(), (rows, *first.shape[1:]))


@contextlib.contextmanager
def _plain_tensors() -> Iterator[None]:
    """No autograd, and tensors that are not inference tensors even when the caller runs under
    torch.inference_mode() (an engine is built inside a request): the parameters become views
    of what is made here, and an inference tensor refuses the in-place updates of weights."""
    with torch.inference_mode(False), torch.no_grad():
        yield


class FusedProjection:
    """Linear modules over one input whose weights (and biases) are row blocks of one tensor:
    `linear` is what F.linear takes for all of them at once, `sizes` their output features,
    in order."""

    def __init__(self, parts: Sequence[torch.nn.Linear]) -> None:
        self.parts = tuple(parts)
        self.sizes = tuple(int(part.out_features) for part in self.parts)
        starts = [sum(self.sizes[:i]) for i in range(len(self.sizes) + 1)]
        self._rows = tuple(slice(a, b) for a, b in zip(starts, starts[1:], strict=False))
        self._attributes = ("weight",) if self.parts[0].bias is None else ("weight", "bias")
        self._fused = {name: self._fuse(name) for name in self._attributes}
        self._addresses = self._expected_addresses()

    @property
    def linear(self) -> Linear:
        return self._fused["weight"], self._fused.get("bias")

    def _blocks(self, name: str) -> list[tuple[torch.nn.Parameter, slice]]:
        """Each part's parameter `name` with its rows of the fused tensor."""
        pairs = zip(self.parts, self._rows, strict=True)
        return [(getattr(part, name), rows) for part, rows in pairs]

    def _fuse(self, name: str) -> torch.Tensor:
        """The fused tensor of attribute `name`: the parts' own when they are already its
        blocks (another Forward of this model fused them), else a new one they become views of."""
        tensors = [getattr(part, name) for part in self.parts]
        with _plain_tensors():
            fused = _joined(tensors)
            if fused is None:
                fused = torch.cat([t.detach() for t in tensors])
                self._point(name, fused)
        return fused

    def _point(self, name: str, fused: torch.Tensor) -> None:
        for param, rows in self._blocks(name):
            param.data = fused[rows]

    def _expected_addresses(self) -> tuple[int, ...]:
        return tuple(
            self._fused[name][rows].data_ptr()
            for name in self._attributes
            for _, rows in self._blocks(name)
        )

    def _addresses_now(self) -> tuple[int, ...]:
        return tuple(
            param.data_ptr() for name in self._attributes for param, _ in self._blocks(name)
        )

    def intact(self) -> bool:
        """Whether every part is still the view of its block (writes reach the fused tensor):
        a parameter's address is its block's only while it is that view (checked by address
        alone: it runs before every batch, so it must cost microseconds)."""
        return self._addresses_now() == self._addresses

    def refresh(self) -> bool:
        """Make a part rebound elsewhere a view of its block again, its current values copied
        into the block (the fused tensor keeps its address; a new one when the parts moved to
        another device or dtype). Returns whether anything had to change."""
        if self.intact():
            return False
        with _plain_tensors():
            for name in self._attributes:
                fused = self._fused[name]
                blocks = self._blocks(name)
                if any(p.device != fused.device or p.dtype != fused.dtype for p, _ in blocks):
                    self._fused[name] = fused = torch.cat([p.detach() for p, _ in blocks])
                else:
                    for param, rows in blocks:
                        if param.data_ptr() != fused[rows].data_ptr():
                            fused[rows].copy_(param)
                self._point(name, fused)
        self._addresses = self._expected_addresses()
        return True


def fuse(parts: Sequence[torch.nn.Linear]) -> FusedProjection | None:
    """The parts as one FusedProjection, or None where they cannot be one GEMM: different
    inputs, dtypes or devices, or biases on some parts only."""
    first = parts[0]
    for part in parts:
        if (
            part.in_features != first.in_features
            or part.weight.dtype != first.weight.dtype
            or part.weight.device != first.weight.device
            or (part.bias is None) != (first.bias is None)
        ):
            return None
    return FusedProjection(parts)
