"""LoRA adapters in PEFT naming, merged into the model's weights: W = W_base + (alpha / r) * B @ A.

Adapters are absolute, not incremental. The first time an adapter touches a module, LoraState
keeps a host copy of that module's weight (its base); every merge computes W from that copy, so:

* sending the same adapter twice gives bit-identical weights (idempotent);
* a different adapter replaces the previous one: modules it touches are re-merged from their
  bases, and modules only the previous adapter touched get their base back (and are forgotten);
* a later FULL or PARTIAL update that writes a module's weight makes the written value the new
  truth: apply forgets that module's base, and the next adapter captures the new weight as base.

Names: "base_model.model.<module>.lora_A.weight" and "...lora_B.weight" (the prefix is optional),
where "<module>.weight" is a 2-D floating weight of the model. A is (r, in), B is (out, r); with
fan_in_fan_out the weight is stored (in, out) (GPT-2's Conv1D) and the delta is transposed.

Rank bound: r is at most min(in, out) of every module the adapter touches (a larger rank adds
nothing a full-rank delta could not, and the header's rank sizes the staging arena: without the
bound, rank 2**28 on a 64x64 projection claimed 137 GB). plan_lora checks it with the shapes,
when the file's head is parsed, before the arena is allocated.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from ...client.protocol.errors import InvalidArgument
from .header import StreamEntry, preview
from .options import LoraParams
from .spec import ModelSpec, TargetTensor

__all__ = [
    "PEFT_PREFIX",
    "LoraState",
    "LoraTarget",
    "apply_lora",
    "merged_weight",
    "plan_lora",
]

PEFT_PREFIX = "base_model.model."
_FACTOR_SUFFIXES = {".lora_A.weight": "A", ".lora_B.weight": "B"}


@dataclass(frozen=True)
class LoraTarget:
    """One module's adapter: its weight and the two factors in the file."""

    weight: TargetTensor
    a: StreamEntry  # (r, in)
    b: StreamEntry  # (out, r)


def _module_of(name: str, spec: ModelSpec) -> tuple[str, str] | None:
    """(module name, "A" | "B") for a PEFT factor name of one of the model's weights, else None."""
    for suffix, factor in _FACTOR_SUFFIXES.items():
        if not name.endswith(suffix):
            continue
        module = name[: -len(suffix)]
        candidates = [module]
        if module.startswith(PEFT_PREFIX):
            candidates.insert(0, module[len(PEFT_PREFIX) :])
        for candidate in candidates:
            if f"{candidate}.weight" in spec.tensors:
                return candidate, factor
    return None


def _check_pair(
    weight: TargetTensor, a: StreamEntry, b: StreamEntry, params: LoraParams
) -> LoraTarget:
    if len(weight.shape) != 2 or not weight.dtype.is_floating_point:
        raise InvalidArgument(f"{weight.name}: LoRA needs a 2-D floating weight")
    for factor in (a, b):
        if not factor.dtype.is_floating_point:
            raise InvalidArgument(
                f"{factor.name}: LoRA factors must be floating, got {factor.dtype_name}"
            )
    rows, cols = weight.shape
    fan_in, fan_out = (rows, cols) if params.fan_in_fan_out else (cols, rows)
    rank = params.rank
    if rank > min(fan_in, fan_out):
        raise InvalidArgument(
            f"header.lora.rank: {rank} is above min(in {fan_in}, out {fan_out}) = "
            f"{min(fan_in, fan_out)} of {weight.name}; a LoRA rank is at most the smaller side of "
            "every weight it adapts"
        )
    if a.shape != (rank, fan_in):
        raise InvalidArgument(
            f"{a.name}: shape {list(a.shape)}, expected [rank {rank}, in {fan_in}] for "
            f"{weight.name} {list(weight.shape)}"
        )
    if b.shape != (fan_out, rank):
        raise InvalidArgument(
            f"{b.name}: shape {list(b.shape)}, expected [out {fan_out}, rank {rank}] for "
            f"{weight.name} {list(weight.shape)}"
        )
    return LoraTarget(weight, a, b)


def plan_lora(
    entries: Sequence[StreamEntry], spec: ModelSpec, params: LoraParams
) -> tuple[LoraTarget, ...]:
    """Pair every A with its B, map them onto the model's weights and check the shapes."""
    factors: dict[str, dict[str, StreamEntry]] = {}
    unknown = []
    for entry in entries:
        found = _module_of(entry.name, spec)
        if found is None:
            unknown.append(entry.name)
            continue
        module, factor = found
        slot = factors.setdefault(module, {})
        if factor in slot:
            raise InvalidArgument(
                f"two lora_{factor} tensors for {module}: {slot[factor].name}, {entry.name}"
            )
        slot[factor] = entry
    if unknown:
        raise InvalidArgument(
            f"{len(unknown)} tensor(s) are not LoRA factors of the model's weights (expected "
            f"'<module>.lora_A.weight' / '<module>.lora_B.weight'): {preview(unknown)}"
        )
    missing = [
        f"{module}.lora_{'B' if 'A' in slot else 'A'}.weight"
        for module, slot in factors.items()
        if len(slot) != 2
    ]
    if missing:
        raise InvalidArgument(f"{len(missing)} LoRA factor(s) missing: {preview(missing)}")
    return tuple(
        _check_pair(spec.tensors[f"{module}.weight"], slot["A"], slot["B"], params)
        for module, slot in factors.items()
    )


def merged_weight(
    base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, scale: float, fan_in_fan_out: bool
) -> torch.Tensor:
    """base + scale * B @ A, computed in float32 and cast to the base's dtype."""
    delta = b.float() @ a.float()  # (out, r) @ (r, in) -> (out, in)
    if fan_in_fan_out:
        delta = delta.T  # the weight is stored (in, out)
    return (base.float() + scale * delta).to(base.dtype)


class LoraState:
    """Host copies of the base weights of the modules the current adapter modifies, per model.

    Used only by apply, on the engine thread; not thread-safe. One instance per model.
    """

    def __init__(self) -> None:
        self._bases: dict[str, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self._bases)

    def names(self) -> frozenset[str]:
        """State-dict names of the weights that currently hold a merged adapter."""
        return frozenset(self._bases)

    def base(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        """The base of `name`, captured from `weight` (on the host) the first time it is asked."""
        if name not in self._bases:
            self._bases[name] = weight.detach().to(
                "cpu", memory_format=torch.contiguous_format, copy=True
            )
        return self._bases[name]

    def forget(self, name: str) -> None:
        """Drop the base of `name`: its current value is the truth from now on."""
        self._bases.pop(name, None)


def apply_lora(
    model_tensors: Mapping[str, torch.Tensor],
    targets: Sequence[LoraTarget],
    staged: Mapping[str, torch.Tensor],
    state: LoraState,
    params: LoraParams,
) -> None:
    """Merge the adapter into the weights, replacing the last one (caller holds torch.no_grad).

    With params.check_finite (header.allow_non_finite off), an adapter whose merge is NaN or
    infinite anywhere is refused before any weight is written: the factors' values were checked
    as they arrived, but finite factors can overflow in alpha / r * B @ A or in the cast to the
    weight's dtype. A bound decides for every sane adapter (`_surely_finite`); a merge it cannot
    vouch for is computed and checked first (one weight-sized temporary at a time) and again to
    be written (deterministic: bit for bit the checked values).
    """
    if params.check_finite:
        known = state.names()
        for target, weight, base, a, b in _parts(model_tensors, targets, staged):
            # Bases not captured yet are read, not captured: a refusal leaves `state` as it was.
            base = state.base(target.weight.name, weight) if target.weight.name in known else base
            if _surely_finite(base, a, b, params.scale):
                continue
            merged = merged_weight(base.cpu(), a, b, scale=params.scale,
                                   fan_in_fan_out=params.fan_in_fan_out)  # fmt: skip
            if not bool(torch.isfinite(merged).all()):
                raise InvalidArgument(
                    f"{target.weight.name}: merging the LoRA adapter (alpha / rank * B @ A) gives "
                    f"NaN or infinite values in {merged.dtype} (header.allow_non_finite is off); "
                    "nothing was written"
                )
    touched = set()
    for target, weight, _, a, b in _parts(model_tensors, targets, staged):
        base = state.base(target.weight.name, weight)
        merged = merged_weight(base, a, b, scale=params.scale, fan_in_fan_out=params.fan_in_fan_out)
        # Merged on the host and copied in one go: no device temporaries.
        weight.copy_(merged)
        touched.add(target.weight.name)
    for name in state.names() - touched:
        model_tensors[name].copy_(state.base(name, model_tensors[name]))
        state.forget(name)


def _parts(
    model_tensors: Mapping[str, torch.Tensor],
    targets: Sequence[LoraTarget],
    staged: Mapping[str, torch.Tensor],
) -> Iterator[tuple[LoraTarget, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(target, its live weight, that weight detached, its A, its B) for each target."""
    for target in targets:
        weight = model_tensors[target.weight.name]
        yield target, weight, weight.detach(), staged[target.a.name], staged[target.b.name]


def _surely_finite(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> bool:
    """Whether base + scale * B @ A is finite in float32 and in base's dtype by a bound alone:
    |merged| <= max|base| + |scale| * r * max|A| * max|B| (each of the r products of a dot is at
    most max|A| * max|B|), with half the dtype's range to spare for rounding. False when the
    bound says nothing (then the merge itself is checked); NaN anywhere makes it False."""
    if not base.dtype.is_floating_point:
        return False
    largest = min(torch.finfo(base.dtype).max, torch.finfo(torch.float32).max) / 2
    tops = [float(t.detach().abs().amax()) if t.numel() else 0.0 for t in (base, a, b)]
    bound = tops[0] + abs(scale) * a.shape[0] * tops[1] * tops[2]
    return bound < largest  # False for NaN and infinity
