"""Verify an incoming file against the target model before anything is applied.

Names (by mode), shapes and dtypes are checked as soon as the header is parsed, so a wrong file
is refused before its data is received; values (finite, in range, valid bools) are checked as
they arrive, chunk by chunk, every element once, before anything is applied. Only the model's
metadata is read here, never written.

Dtype rules (wire dtype -> parameter or buffer dtype):

* A floating tensor (F16, BF16, F32, F64) may update any floating parameter. It is staged in its
  wire dtype and cast to the parameter's dtype when applied, e.g. float32 into a bfloat16 model.
  When the parameter's dtype has a smaller range (float32 into float16), a finite value beyond
  the parameter dtype's largest finite value is refused, since the cast would make it infinite.
* Integer and bool tensors must match the parameter's dtype exactly (no silent wrap-around).
* Integer or bool tensors for a floating parameter, and floating tensors for an integer or bool
  buffer, are refused.
* NaN and infinity in floating tensors are refused unless header.allow_non_finite, which also
  lifts the range rule above. Bool tensors must hold only 0 and 1.

Where values are checked: in a host arena, chunk by chunk on the host (`check_values`); in a
device arena (pipeline.py), per whole tensor on the device (`DeferredValues`): one min/max
reduction per tensor, enqueued without waiting, read back all at once when the file is complete.
A failure is named by the first offending tensor in data order, with the message
`check_values` gives for it.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np
import torch

from ...client.protocol.errors import InvalidArgument
from ...v1 import rollout_pb2 as pb
from .header import StreamEntry, check_manifest, preview
from .lora import LoraTarget, plan_lora
from .options import UpdateOptions
from .spec import ModelSpec, TargetTensor

__all__ = [
    "UpdateChecks",
    "UpdatePlan",
    "DeferredValues",
    "ValueRule",
    "check_values",
    "max_magnitude",
    "plan_update",
]


@dataclass(frozen=True)
class ValueRule:
    """What to check in a tensor's values once it has arrived."""

    check_finite: bool
    max_abs: float | None = None  # largest finite value the parameter's dtype can hold


@dataclass(frozen=True)
class UpdatePlan:
    """What apply will do: copy file tensors into targets, or merge LoRA factors into weights."""

    copies: tuple[tuple[StreamEntry, TargetTensor], ...]
    lora: tuple[LoraTarget, ...]
    rules: Mapping[str, ValueRule]  # file tensor name -> value checks


def _dtype_rule(entry: StreamEntry, target: TargetTensor, allow_non_finite: bool) -> ValueRule:
    """Apply the module docstring's dtype rules; the returned rule checks the values later."""
    if target.dtype.is_floating_point != entry.dtype.is_floating_point:
        kind = "floating" if entry.dtype.is_floating_point else "integer/bool"
        raise InvalidArgument(
            f"{entry.name}: {kind} tensor ({entry.dtype_name}) cannot update a "
            f"{target.dtype} tensor"
        )
    if not target.dtype.is_floating_point:
        if entry.dtype != target.dtype:
            raise InvalidArgument(
                f"{entry.name}: dtype {entry.dtype_name} must equal the model's {target.dtype}"
            )
        return ValueRule(check_finite=False)
    if allow_non_finite:
        return ValueRule(check_finite=False)
    target_max = torch.finfo(target.dtype).max
    narrowing = target_max < torch.finfo(entry.dtype).max
    return ValueRule(check_finite=True, max_abs=target_max if narrowing else None)


def _plan_copies(
    entries: Sequence[StreamEntry], spec: ModelSpec, options: UpdateOptions
) -> UpdatePlan:
    names = [e.name for e in entries]
    unknown = [n for n in names if n not in spec.tensors]
    if unknown:
        raise InvalidArgument(f"{len(unknown)} unknown tensor name(s): {preview(unknown)}")
    if options.mode == pb.UPDATE_MODE_FULL:
        covered = {spec.root[n] for n in names}
        missing = [n for n in spec.tensors if spec.root[n] == n and n not in covered]
        if missing:
            raise InvalidArgument(
                f"full update misses {len(missing)} tensor(s) of the model: {preview(missing)}"
            )
    copies = []
    rules = {}
    for entry in entries:
        target = spec.tensors[entry.name]
        if entry.shape != target.shape:
            raise InvalidArgument(
                f"{entry.name}: shape {list(entry.shape)} differs from the model's "
                f"{list(target.shape)}"
            )
        rules[entry.name] = _dtype_rule(entry, target, options.allow_non_finite)
        copies.append((entry, target))
    return UpdatePlan(tuple(copies), (), MappingProxyType(rules))


def plan_update(
    entries: Sequence[StreamEntry], spec: ModelSpec, options: UpdateOptions
) -> UpdatePlan:
    """Check the file's tensors against the model for the header's mode; InvalidArgument if not."""
    if not entries:
        raise InvalidArgument("the safetensors file holds no tensors")
    if options.mode == pb.UPDATE_MODE_LORA:
        assert options.lora is not None
        targets = plan_lora(entries, spec, options.lora)
        rule = ValueRule(check_finite=not options.allow_non_finite)
        return UpdatePlan((), targets, MappingProxyType({e.name: rule for e in entries}))
    return _plan_copies(entries, spec, options)


# The integer views of each float width. With the sign bit cleared, a float's bits order like its
# magnitude (IEEE 754): infinity above every finite value, NaN above infinity.
_SIGNED = {2: torch.int16, 4: torch.int32, 8: torch.int64}
_UNSIGNED = {2: np.uint16, 4: np.uint32, 8: np.uint64}
_AS_FLOAT = {torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64}


def max_magnitude(values: torch.Tensor) -> float:
    """max |x| of a non-empty floating tensor: inf if it holds an infinity, NaN if a NaN.

    Two max passes over the bits in numpy, no temporaries: as signed integers the largest is the
    largest non-negative value (or, with none, the negative one of largest magnitude, offset by
    -2**(w-1)); as unsigned integers, the negative one of largest magnitude offset by +2**(w-1)
    (or, with none, the largest non-negative). Single-threaded on purpose: a torch reduction of
    a chunk wakes torch's OpenMP pool, whose barrier then waits for a core that gRPC keeps busy
    (under load, many times slower than these numpy passes).
    """
    itemsize = values.dtype.itemsize
    half = 1 << (8 * itemsize - 1)  # the sign bit
    signed = values.detach().contiguous().reshape(-1).view(_SIGNED[itemsize]).numpy()
    largest_signed = int(signed.max())
    largest_unsigned = int(signed.view(_UNSIGNED[itemsize]).max())
    magnitude = max(
        largest_signed if largest_signed >= 0 else largest_signed + half,
        largest_unsigned - half if largest_unsigned >= half else largest_unsigned,
    )
    if values.dtype == torch.bfloat16:  # bfloat16 is float32 with the low 16 bits cut off
        return float(np.array(magnitude << 16, dtype=np.uint32).view(np.float32))
    return float(np.array(magnitude, dtype=_UNSIGNED[itemsize]).view(_AS_FLOAT[values.dtype]))


def _sum_is_finite(values: torch.Tensor) -> bool:
    """One pass instead of max_magnitude's two: a float32/64 sum of squares is NaN or infinite
    whenever a NaN or an infinity is among the values (inf * inf is inf, NaN stays NaN, and
    x + inf is inf or NaN, never finite). A finite sum proves them finite; a non-finite one may
    also be an overflow of large finite values (|x| > 1.8e19 in float32), so the caller then
    runs the exact check. The sum of squares is a BLAS dot product, faster than np.add.reduce
    (bench/RESULTS.md), and single-threaded at these sizes, for the same reason as
    max_magnitude."""
    if values.dtype not in (torch.float32, torch.float64):
        return False
    flat = values.detach().contiguous().reshape(-1).numpy()
    return bool(np.isfinite(np.dot(flat, flat)))


def check_values(name: str, tensor: torch.Tensor, rule: ValueRule) -> None:
    """Refuse bools other than 0/1, and (per rule) NaN, infinity or values out of range."""
    if not tensor.numel():
        return
    if tensor.dtype == torch.bool:
        if int(tensor.detach().contiguous().view(torch.uint8).numpy().max()) > 1:
            raise InvalidArgument(f"{name}: bool tensor holds bytes other than 0 and 1")
        return
    if not rule.check_finite or not tensor.dtype.is_floating_point:
        return
    if rule.max_abs is None and _sum_is_finite(tensor):
        return  # no NaN and no infinity (the fast path of the common, same-dtype update)
    limit = rule.max_abs if rule.max_abs is not None else torch.finfo(tensor.dtype).max
    largest = max_magnitude(tensor)  # NaN fails the comparison too
    if largest <= limit:
        return
    if math.isfinite(largest):
        low, high = (float(v) for v in torch.aminmax(tensor))  # the signed extreme, for the message
        extreme = high if high > limit else low
        raise InvalidArgument(
            f"{name}: value {extreme:g} is beyond the model dtype's largest finite value {limit:g}"
        )
    raise InvalidArgument(f"{name}: NaN or infinite values (header.allow_non_finite is off)")


@dataclass(frozen=True)
class _Pending:
    """One tensor's device check in flight: its place in data order and its extremes."""

    order: int
    name: str
    rule: ValueRule
    values: torch.Tensor  # the staged tensor, 1-D wire dtype (a view of the arena)
    low: torch.Tensor  # 0-dim, on the device (uint8 for bools)
    high: torch.Tensor


class DeferredValues:
    """`check_values` for tensors on a device, enqueued per tensor and judged once at the end.

    `add` runs one aminmax per tensor that needs a check, on the caller's current stream, and
    keeps the two 0-dim results without reading them: no host sync per tensor. NaN propagates
    through min and max, an infinity is an extreme, and a value out of range is too, so the
    extremes decide every rule of check_values. `settle` (after the stream was synchronised)
    copies all extremes to the host at once and, for the first tensor that fails, re-runs
    check_values on a host copy of it, so the message is check_values' own.
    """

    def __init__(self) -> None:
        self._pending: list[_Pending] = []
        self._lock = threading.Lock()

    def add(self, order: int, name: str, values: torch.Tensor, rule: ValueRule) -> None:
        if not values.numel():
            return
        if values.dtype == torch.bool:
            low, high = torch.aminmax(values.view(torch.uint8))
        elif rule.check_finite and values.dtype.is_floating_point:
            low, high = torch.aminmax(values)
        else:
            return
        with self._lock:
            self._pending.append(_Pending(order, name, rule, values, low, high))

    def settle(self) -> None:
        with self._lock:
            pending = sorted(self._pending, key=lambda p: p.order)
            self._pending = []
        if not pending:
            return
        by_dtype: dict[torch.dtype, list[int]] = {}
        for position, item in enumerate(pending):
            by_dtype.setdefault(item.low.dtype, []).append(position)
        extremes: dict[int, tuple[float, float]] = {}
        for positions in by_dtype.values():
            pairs = [t for p in positions for t in (pending[p].low, pending[p].high)]
            # float64 holds every value of every wire dtype exactly (and NaN, and infinities).
            host = torch.stack(pairs).to("cpu", torch.float64).tolist()
            for k, p in enumerate(positions):
                extremes[p] = (host[2 * k], host[2 * k + 1])
        for position, item in enumerate(pending):
            low, high = extremes[position]
            if _passes(item.values.dtype, item.rule, low, high):
                continue
            check_values(item.name, item.values.cpu(), item.rule)
            raise InvalidArgument(f"{item.name}: values out of range (checked on the device)")


def _passes(dtype: torch.dtype, rule: ValueRule, low: float, high: float) -> bool:
    if dtype == torch.bool:
        return high <= 1
    limit = rule.max_abs if rule.max_abs is not None else torch.finfo(dtype).max
    return -limit <= low and high <= limit  # False for NaN


class UpdateChecks:
    """The StreamChecks of one update: manifest and plan at the header, value rules per run
    (host arenas) or per tensor on the device (device arenas)."""

    def __init__(self, spec: ModelSpec, options: UpdateOptions) -> None:
        self._spec = spec
        self._options = options
        self.plan: UpdatePlan | None = None
        self._deferred = DeferredValues()
        self._order: dict[str, int] = {}

    def check_header(self, entries: Sequence[StreamEntry]) -> None:
        check_manifest(entries, self._options.manifest)
        self.plan = plan_update(entries, self._spec, self._options)
        self._order = {entry.name: index for index, entry in enumerate(entries)}

    def check_elements(self, entry: StreamEntry, values: torch.Tensor) -> None:
        assert self.plan is not None
        check_values(entry.name, values, self.plan.rules[entry.name])

    def check_tensor(self, entry: StreamEntry, values: torch.Tensor) -> None:
        assert self.plan is not None
        rule = self.plan.rules[entry.name]
        self._deferred.add(self._order[entry.name], entry.name, values, rule)

    def settle(self) -> None:
        self._deferred.settle()
