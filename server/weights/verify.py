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
device arena (pipeline.py), on the device (`DeferredValues`): one min/max reduction per run of
back-to-back tensors of one dtype and rule (`plan_check_groups`, planned once per head), enqueued
without waiting once the run's bytes arrived, read back all at once when the file is complete.
A failure is named by the first offending tensor in data order, with the message
`check_values` gives for it.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Hashable, Mapping, Sequence
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
    "CheckGroup",
    "UpdateChecks",
    "UpdatePlan",
    "DeferredValues",
    "ValueRule",
    "check_values",
    "max_magnitude",
    "plan_check_groups",
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


def _needs_check(dtype: torch.dtype, rule: ValueRule) -> bool:
    """Whether check_values can refuse a tensor of `dtype` under `rule` (bools, or floats when
    the rule checks finiteness)."""
    return dtype == torch.bool or (rule.check_finite and dtype.is_floating_point)


def check_values(name: str, tensor: torch.Tensor, rule: ValueRule) -> None:
    """Refuse bools other than 0/1, and (per rule) NaN, infinity or values out of range."""
    if not tensor.numel() or not _needs_check(tensor.dtype, rule):
        return
    if tensor.dtype == torch.bool:
        if int(tensor.detach().contiguous().view(torch.uint8).numpy().max()) > 1:
            raise InvalidArgument(f"{name}: bool tensor holds bytes other than 0 and 1")
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


# Tensors that lie back to back in the arena, with one dtype and one rule, are checked by one
# reduction over all of them, up to this many bytes: one launch instead of one per tensor (a
# model has hundreds, each launch costs host time), and still several per update, so most checks
# run on the device while later bytes are being copied.
GROUP_BYTES = 256 << 20


@dataclass(frozen=True)
class CheckGroup:
    """Tensors that follow each other in the data section with one dtype and one rule, checked
    by one reduction once every byte of [data_begin, data_end) arrived. Such neighbours are back
    to back in the arena too (plan_arena shifts only a tensor whose start is misaligned for its
    itemsize, which a same-dtype neighbour's is not), so the group is one run of arena bytes."""

    rule: ValueRule
    dtype: torch.dtype
    names: tuple[str, ...]  # the members, in data order
    sizes: tuple[int, ...]  # each member's bytes
    data_begin: int
    data_end: int


def plan_check_groups(
    entries: Sequence[StreamEntry], rules: Mapping[str, ValueRule], group_bytes: int | None = None
) -> tuple[CheckGroup, ...]:
    """The device value checks of a file: its tensors that need one, in data order, grouped
    while they follow each other with one dtype and rule, each group closed once it holds
    `group_bytes` (default GROUP_BYTES; 0: one group per tensor). Planned once per head, so
    receiving costs host work per group, not per tensor."""
    limit = GROUP_BYTES if group_bytes is None else group_bytes
    runs: list[list[StreamEntry]] = []
    run_bytes = 0
    for entry in entries:
        rule = rules[entry.name]
        if not entry.nbytes or not _needs_check(entry.dtype, rule):
            continue
        last = runs[-1][-1] if runs else None
        if (
            last is None
            or entry.begin != last.end
            or entry.dtype != last.dtype
            or rule != rules[last.name]
            or run_bytes >= limit
        ):
            runs.append([])
            run_bytes = 0
        runs[-1].append(entry)
        run_bytes += entry.nbytes
    return tuple(
        CheckGroup(
            rules[run[0].name],
            run[0].dtype,
            tuple(e.name for e in run),
            tuple(e.nbytes for e in run),
            run[0].begin,
            run[-1].end,
        )
        for run in runs
    )


class DeferredValues:
    """`check_values` for the groups of a device arena, launched as they complete, judged once.

    `launch(index, raw)` runs one aminmax over group `index`'s arena bytes on the caller's
    current stream and keeps the two 0-dim results without reading them: no host sync per group.
    NaN propagates through min and max, an infinity is an extreme, and a value out of range is
    too, so the extremes decide every rule of check_values, for a group as for each of its
    tensors. `settle` (after the stream was synchronised) copies all extremes to the host at
    once and, in the first group that fails, re-runs check_values on a host copy of each member
    in data order until one fails, so the message is check_values' own, naming the first
    offending tensor.
    """

    def __init__(self, groups: Sequence[CheckGroup]) -> None:
        self._groups = tuple(groups)
        # By group: its arena bytes and its (low, high) on the device, once launched.
        self._launched: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._lock = threading.Lock()

    @property
    def groups(self) -> tuple[CheckGroup, ...]:
        return self._groups

    def launch(self, index: int, raw: torch.Tensor) -> None:
        """Enqueue group `index`'s reduction over `raw`, its arena bytes (1-D uint8)."""
        group = self._groups[index]
        values = raw.view(torch.uint8 if group.dtype == torch.bool else group.dtype)
        low, high = torch.aminmax(values)
        with self._lock:
            self._launched[index] = (raw, low, high)

    def settle(self) -> None:
        """Raise the first failure in data order (after every group was launched: the pipeline
        launches each once all its bytes arrived, and `finish` runs once they all did)."""
        with self._lock:
            launched, self._launched = self._launched, {}
        refusal = None
        try:
            self._judge(launched)
        except InvalidArgument as error:
            # Raised anew below, without the traceback whose frames hold the arena bytes
            # (staged in place, they are a trainer's CUDA IPC memory, unmapped at the plane's
            # exit: no reference may outlive it).
            refusal = InvalidArgument(str(error))
        finally:
            launched = {}
        if refusal is not None:
            raise refusal

    def _judge(self, launched: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        unchecked = [g.names[0] for i, g in enumerate(self._groups) if i not in launched]
        if unchecked:
            raise AssertionError(f"the value checks of {unchecked[0]} never ran")
        if not launched:
            return
        by_dtype: dict[torch.dtype, list[int]] = {}
        for index, (_, low, _) in launched.items():
            by_dtype.setdefault(low.dtype, []).append(index)
        extremes: dict[int, tuple[float, float]] = {}
        for indices in by_dtype.values():
            pairs = [t for i in indices for t in launched[i][1:]]
            # float64 holds every value of every wire dtype exactly (and NaN, and infinities).
            host = torch.stack(pairs).to("cpu", torch.float64).tolist()  # type: ignore[misc]
            for k, i in enumerate(indices):
                extremes[i] = (host[2 * k], host[2 * k + 1])
        for index, group in enumerate(self._groups):
            low, high = extremes[index]
            if _passes(group.dtype, group.rule, low, high):
                continue
            raw = launched[index][0]
            start = 0
            for name, size in zip(group.names, group.sizes, strict=True):
                # The first offending tensor words the refusal.
                check_values(name, raw[start : start + size].view(group.dtype).cpu(), group.rule)
                start += size
            raise InvalidArgument(f"{group.names[0]}: values out of range (checked on the device)")


def _passes(dtype: torch.dtype, rule: ValueRule, low: float, high: float) -> bool:
    if dtype == torch.bool:
        return high <= 1
    limit = rule.max_abs if rule.max_abs is not None else torch.finfo(dtype).max
    return -limit <= low and high <= limit  # False for NaN


class UpdateChecks:
    """The StreamChecks of one update: manifest, plan and device check groups at the header,
    value rules per run (host arenas) or per group on the device (device arenas).

    What the header's checks derive (`verified`) depends only on the head's bytes, the model's
    names, shapes and dtypes, and `head_key`; a stager that saw the same head before hands it
    back with `reuse` instead of parsing and planning again (stream.py, VerifiedHead)."""

    def __init__(
        self,
        read_spec: Callable[[], ModelSpec],
        options: UpdateOptions,
    ) -> None:
        # read_spec: the target model's spec, read only when a head is checked (not reused).
        self._read_spec = read_spec
        self._options = options
        self.plan: UpdatePlan | None = None
        self._deferred = DeferredValues(())

    def head_key(self) -> Hashable:
        """What, besides the head's bytes, the plan depends on: the header's mode, rules and
        manifest (the model is the arena's, one per model)."""
        options = self._options
        return (options.mode, options.lora, options.allow_non_finite, options.manifest_key)

    def check_header(self, entries: Sequence[StreamEntry]) -> None:
        check_manifest(entries, self._options.manifest)
        self.plan = plan_update(entries, self._read_spec(), self._options)
        self._deferred = DeferredValues(plan_check_groups(entries, self.plan.rules))

    @property
    def verified(self) -> tuple[UpdatePlan, tuple[CheckGroup, ...]]:
        """What check_header derived (after it passed): for `reuse` by a later update."""
        assert self.plan is not None
        return self.plan, self._deferred.groups

    def reuse(self, verified: object) -> None:
        """Take what check_header derived for the same head bytes and head_key before."""
        plan, groups = verified  # type: ignore[misc]
        self.plan = plan
        self._deferred = DeferredValues(groups)

    def check_elements(self, entry: StreamEntry, values: torch.Tensor) -> None:
        assert self.plan is not None
        check_values(entry.name, values, self.plan.rules[entry.name])

    def device_groups(self) -> tuple[CheckGroup, ...]:
        return self._deferred.groups

    def launch_check(self, index: int, raw: torch.Tensor) -> None:
        self._deferred.launch(index, raw)

    def settle(self) -> None:
        self._deferred.settle()
