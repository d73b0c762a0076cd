"""An apply's copies merged where both sides continue in memory: one copy per run, not per tensor.

An update applied from device memory (a device arena, or the trainer's own buffer staged in
place) copies each staged tensor into its parameter. Where the parameters lie back to back in
one storage in the update file's order (models/memory.py lays out a CUDA model so) and the
staged tensors do too (an arena keeps file offsets; a trainer's flattened weights are the data
section), a run of tensors is one copy of bytes: a 291-tensor update of a Qwen2-0.5B-shaped
model becomes one or a few copies instead of a multi-tensor copy over 291 pairs, whose host
cost (0.4-0.6 ms on the H200's host, bench/RESULTS.md) is a large part of a colocated update's
apply.

Merged only when it is the same copy: same dtype (no cast), both contiguous, each side inside
one storage and continuing the run's last byte. A destination written by several pairs (a tied
weight sent under both its names) is written once, by the last of them: what copies in order
leave, and no two copies of one multi-tensor call racing for the same bytes.

Finding the runs costs ~2 us a pair in Python, as much as the launches it saves; a trainer sends
the same tensors at every step, so `CopyPlans` keeps the last plan per model, keyed by every
pair's addresses and sizes (~0.5 us a pair to check) and the update plan it was made for; a
plan that merged nothing is not keyed again for the same update plan.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["CopyPlan", "CopyPlans", "Copies", "Pair", "copy_all", "plan_copies"]

Pair = tuple[torch.Tensor, torch.Tensor]  # (destination, source), as copy_ takes them
# Per pair: destination address, source address, bytes.
PairsKey = tuple[tuple[int, int, int], ...]


@dataclass(frozen=True)
class Copies:
    """What an apply issues: byte runs, each one `copy_` (a device memcpy on CUDA, at the
    copy's full bandwidth: a multi-tensor copy kernel moves uint8 four bytes a thread), and
    the pairs as they are, one multi-tensor copy for all of them."""

    runs: list[Pair]
    each: list[Pair]

    def __len__(self) -> int:
        return len(self.runs) + len(self.each)

    @property
    def devices(self) -> set[torch.device]:
        """Where the copies run (what to wait for)."""
        return {destination.device for destination, _ in self.runs + self.each}


@dataclass(frozen=True)
class CopyPlan:
    """The copies of a list of pairs: (first pair, bytes) per copy; bytes None: that pair as it
    is (a cast, a strided tensor, or a run of one); else one byte copy from the first pair's
    addresses on. Pairs in no copy were written again later."""

    copies: tuple[tuple[int, int | None], ...]

    def of(self, pairs: Sequence[Pair]) -> Copies:
        """The copies as tensors; ValueError when a run no longer fits in its storages
        (memory reallocated at the same addresses: plan again)."""
        copies = Copies([], [])
        for first, nbytes in self.copies:
            if nbytes is None:
                copies.each.append(pairs[first])
            else:
                destination, source = pairs[first]
                copies.runs.append((_bytes(destination, nbytes), _bytes(source, nbytes)))
        return copies


def _bytes(tensor: torch.Tensor, nbytes: int) -> torch.Tensor:
    """`nbytes` bytes of `tensor`'s storage from its first element on, as a uint8 tensor."""
    storage = tensor.untyped_storage()
    begin = tensor.data_ptr() - storage.data_ptr()
    if begin + nbytes > storage.nbytes():
        raise ValueError("a run of the copy plan no longer fits in its storage")
    view = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    return view.set_(storage, begin, (nbytes,))


def pairs_key(pairs: Sequence[Pair]) -> PairsKey:
    return tuple((d.data_ptr(), s.data_ptr(), d.nbytes) for d, s in pairs)


def plan_copies(pairs: Sequence[Pair], key: PairsKey | None = None) -> CopyPlan:
    """The plan of `pairs` (see the module); `key`: pairs_key(pairs) when the caller has it."""
    key = pairs_key(pairs) if key is None else key
    last = {(ptr, nbytes): index for index, (ptr, _, nbytes) in enumerate(key)}
    copies: list[tuple[int, int | None]] = []
    run: list[int] | None = None  # [first pair, bytes, destination limit, source limit]
    for index, (destination, source) in enumerate(pairs):
        destination_ptr, source_ptr, nbytes = key[index]
        if last[(destination_ptr, nbytes)] != index:
            continue  # written again later
        if (
            destination.dtype != source.dtype
            or nbytes != source.nbytes
            or not destination.is_contiguous()
            or not source.is_contiguous()
        ):
            run = None
            copies.append((index, None))  # a cast or a strided copy: copy_ as it is
            continue
        if run is not None:
            first_destination, first_source, _ = key[run[0]]
            if (
                destination_ptr == first_destination + run[1]
                and source_ptr == first_source + run[1]
                and destination_ptr + nbytes <= run[2]
                and source_ptr + nbytes <= run[3]
            ):
                run[1] += nbytes
                copies[-1] = (run[0], run[1])
                continue
        run = [index, nbytes, _limit(destination), _limit(source)]
        copies.append((index, None))  # a run of one so far
    return CopyPlan(tuple(copies))


def _limit(tensor: torch.Tensor) -> int:
    """The address just past `tensor`'s storage."""
    storage = tensor.untyped_storage()
    return storage.data_ptr() + storage.nbytes()


class CopyPlans:
    """The last CopyPlan of each model, for the same pairs (addresses and sizes) of the same
    update plan (an object that stands for the file's head: dtypes and targets).

    A plan that merged nothing (parameters that are allocations of their own,
    ROLLSERVE_FLAT_WEIGHTS=0) is remembered as such for the head, and later updates of it copy
    their pairs as they are without keying them: that is always right, and what it would plan."""

    def __init__(self) -> None:
        # model -> (head, key, plan; None: the pairs as they are)
        self._plans: weakref.WeakKeyDictionary[
            object, tuple[object, PairsKey | None, CopyPlan | None]
        ] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def copies(self, model: object, head: object, pairs: Sequence[Pair]) -> Copies:
        with self._lock:
            known = self._plans.get(model)
        if known is not None and known[0] is head and known[2] is None:
            return Copies([], list(pairs))
        key = pairs_key(pairs)
        if known is not None and known[0] is head and known[1] == key:
            try:
                return known[2].of(pairs)  # type: ignore[union-attr]
            except ValueError:
                pass
        plan = plan_copies(pairs, key)
        as_they_are = len(plan.copies) == len(pairs)  # nothing merged, nothing dropped
        with self._lock:
            self._plans[model] = (head, None, None) if as_they_are else (head, key, plan)
        return Copies([], list(pairs)) if as_they_are else plan.of(pairs)


def copy_all(pairs: Sequence[Pair], copies: Copies | None = None) -> int:
    """destination.copy_(source) for every pair, as `copies` (their merged runs, plan_copies;
    None: planned here): each byte run one copy_, the other pairs one multi-tensor copy
    (torch._foreach_copy_: on CUDA a few kernels for the same-dtype pairs, copy_ semantics and
    casts for the others, where a copy_ per tensor costs a launch and ~14 us of Python each).
    Returns the copies issued."""
    if copies is None:
        copies = plan_copies(pairs).of(pairs)
    for destination, source in copies.runs:
        destination.copy_(source)
    if copies.each:
        torch._foreach_copy_([d for d, _ in copies.each], [s for _, s in copies.each])
    return len(copies)
