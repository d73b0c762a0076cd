"""An apply's copies merged into runs (server/weights/copy_runs.py): the same bytes written as
copies one pair at a time would write, with one copy per run of memory that continues on both
sides, never across the end of a storage, and the plan of the same pairs reused."""

from __future__ import annotations

import torch
from rollserve.server.weights.copy_runs import CopyPlans, copy_all, plan_copies

SIZES = (6, 10, 4, 8)


def _flat(fill: float, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    buffer = torch.full((sum(SIZES),), fill, dtype=dtype)
    return list(buffer.split(SIZES))


def _sources(seed: int) -> list[torch.Tensor]:
    buffer = torch.randn(sum(SIZES), generator=torch.Generator().manual_seed(seed))
    return list(buffer.split(SIZES))


def _expected(destinations: list[torch.Tensor], sources: list[torch.Tensor]) -> list[torch.Tensor]:
    expected = [d.clone() for d in destinations]
    for out, source in zip(expected, sources, strict=True):
        out.copy_(source)
    return expected


def test_tensors_that_continue_on_both_sides_are_one_copy() -> None:
    destinations, sources = _flat(0.0), _sources(0)
    expected = _expected(destinations, sources)
    assert copy_all(list(zip(destinations, sources, strict=True))) == 1
    for got, want in zip(destinations, expected, strict=True):
        assert torch.equal(got, want)


def test_a_gap_on_either_side_or_a_cast_or_a_strided_tensor_splits_the_run() -> None:
    destinations, sources = _flat(0.0), _sources(1)
    gap = torch.zeros(sum(SIZES) + 3)
    moved = [gap[:6], gap[9:19], gap[19:23], gap[23:31]]  # a gap of 3 before the second
    pairs = list(zip(moved, sources, strict=True))
    assert [n for _, n in plan_copies(pairs).copies] == [None, 22 * 4]
    half = torch.zeros(sum(SIZES), dtype=torch.float64).split(SIZES)
    mixed = [destinations[0], half[1], destinations[2], destinations[3]]  # a cast in the middle
    # The cast alone, and the run on either side of it (the last two tensors continue).
    plan = plan_copies(list(zip(mixed, sources, strict=True)))
    assert plan.copies == ((0, None), (1, None), (2, (SIZES[2] + SIZES[3]) * 4))
    strided = torch.zeros(2, sum(SIZES))[:, 0]  # a column: not contiguous
    expected = _expected(destinations, sources)
    expected[0] = sources[0][:2].clone()
    pairs = [(strided, sources[0][:2]), *zip(destinations[1:], sources[1:], strict=True)]
    assert copy_all(pairs) == 2
    assert torch.equal(strided, expected[0])
    for got, want in zip(destinations[1:], expected[1:], strict=True):
        assert torch.equal(got, want)


def test_a_run_never_crosses_the_end_of_a_storage() -> None:
    """Two storages back to back in memory (views of one bytearray each): the addresses
    continue, the storages do not, so the run stops at the first one's end."""
    raw = bytearray(2 * 64)
    first = torch.frombuffer(memoryview(raw)[:64], dtype=torch.float32)
    second = torch.frombuffer(memoryview(raw)[64:], dtype=torch.float32)
    assert first.untyped_storage().data_ptr() != second.untyped_storage().data_ptr()
    assert second.data_ptr() == first.data_ptr() + 64
    sources = list(torch.randn(32).split(16))
    pairs = [(first, sources[0]), (second, sources[1])]
    assert copy_all(pairs) == 2
    assert torch.equal(first, sources[0]) and torch.equal(second, sources[1])


def test_a_destination_written_twice_takes_the_last_write_once() -> None:
    """A tied weight under both its names: one copy of it, the last pair's, as copies in order
    would leave (and no two copies of one multi-tensor call racing for the same bytes)."""
    destinations, sources = _flat(0.0), _sources(2)
    other = torch.randn(SIZES[0])
    pairs = [*zip(destinations, sources, strict=True), (destinations[0], other)]
    plan = plan_copies(pairs)
    assert sum(1 for first, _ in plan.copies if first == 0) == 0  # the first write dropped
    copy_all(pairs)
    assert torch.equal(destinations[0], other)
    for got, want in zip(destinations[1:], sources[1:], strict=True):
        assert torch.equal(got, want)
    # The same source under both names: written once, from there.
    again = [*zip(destinations, sources, strict=True), (destinations[0], sources[0])]
    assert copy_all(again) == 2
    assert torch.equal(destinations[0], sources[0])


def test_the_plan_of_the_same_pairs_is_kept_and_made_again_when_memory_moved() -> None:
    plans, model, head = CopyPlans(), torch.nn.Linear(1, 1), object()
    destinations, sources = _flat(0.0), _sources(3)
    pairs = list(zip(destinations, sources, strict=True))
    first = plans.copies(model, head, pairs)
    assert len(first) == 1 and len(first.runs) == 1  # one byte run: one copy_
    kept = plans._plans[model][2]
    plans.copies(model, head, pairs)
    assert plans._plans[model][2] is kept  # the same pairs: planned once
    plans.copies(model, object(), pairs)
    assert plans._plans[model][2] is not kept  # another head: planned again
    kept = plans._plans[model][2]
    # A destination rebound to memory of its own: planned again, and written there.
    destinations[1] = torch.zeros(SIZES[1])
    pairs = list(zip(destinations, sources, strict=True))
    head = plans._plans[model][0]
    copies = plans.copies(model, head, pairs)
    assert plans._plans[model][2] is not kept and len(copies) == 3
    copy_all(pairs, copies)
    for got, want in zip(destinations, sources, strict=True):
        assert torch.equal(got, want)


def test_pairs_that_merge_nothing_are_copied_as_they_are_without_a_key() -> None:
    """Parameters that are allocations of their own: the first apply finds nothing to merge;
    later applies of the same update plan copy the pairs as they are (what the plan would be)
    and still write every destination."""
    plans, model, head = CopyPlans(), torch.nn.Linear(1, 1), object()
    destinations = [torch.zeros(n) for n in SIZES]
    sources = _sources(4)
    pairs = list(zip(destinations, sources, strict=True))
    assert plans.copies(model, head, pairs).each == pairs
    assert plans._plans[model][1:] == (None, None)  # remembered as "as they are"
    moved = [(torch.zeros(n), s) for n, s in zip(SIZES, _sources(5), strict=True)]
    copies = plans.copies(model, head, moved)
    assert not copies.runs and [c[0] for c in copies.each] == [d for d, _ in moved]
    copy_all(moved, copies)
    for destination, source in moved:
        assert torch.equal(destination, source)
    # Another update plan: planned again (here: one run, the destinations now continue).
    flat = list(zip(_flat(0.0), sources, strict=True))
    assert len(plans.copies(model, object(), flat)) == 1
