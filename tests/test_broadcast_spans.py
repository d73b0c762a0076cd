"""broadcast_spans: the ranges rank 0 broadcasts and every server receives, from the header."""

from __future__ import annotations

import random

import pytest
from rollserve.client.protocol.process_group import (
    MAX_BROADCASTS,
    PACK_BELOW_BYTES,
    broadcast_spans,
)

MIB = 1 << 20


def _check_tiling(spans: list[tuple[int, int]], data_bytes: int, bucket_bytes: int) -> None:
    position = 0
    for begin, end in spans:
        assert begin == position, "the spans must tile the data section in order"
        assert 0 < end - begin <= bucket_bytes
        position = end
    assert position == data_bytes


def test_large_tensors_go_alone_and_small_neighbours_share_a_broadcast() -> None:
    bucket = 4 * MIB
    tensors = [(0, 100), (100, 300), (300, 300 + 9 * MIB), (300 + 9 * MIB, 400 + 9 * MIB)]
    spans = broadcast_spans(tensors, 400 + 9 * MIB, bucket)
    assert spans == [
        (0, 300),  # two small tensors, one broadcast
        (300, 300 + 4 * MIB),  # the large one in bucket-sized pieces of its own
        (300 + 4 * MIB, 300 + 8 * MIB),
        (300 + 8 * MIB, 300 + 9 * MIB),
        (300 + 9 * MIB, 400 + 9 * MIB),
    ]


def test_packs_stop_at_bucket_bytes_and_gaps_are_sent_too() -> None:
    bucket = 1000
    tensors = [(i * 300, i * 300 + 300) for i in range(7)]  # small next to small
    spans = broadcast_spans(tensors, 2100, bucket)
    assert spans == [(0, 900), (900, 1800), (1800, 2100)]
    # Bytes that belong to no tensor (a hole, a tail) still arrive, in bucket-sized pieces.
    spans = broadcast_spans([(10, 20)], 2500, bucket)
    assert spans == [(0, 20), (20, 1020), (1020, 2020), (2020, 2500)]


def test_no_data_means_no_broadcast() -> None:
    assert broadcast_spans([], 0, MIB) == []
    assert broadcast_spans([(0, 0), (0, 0)], 0, MIB) == []


@pytest.mark.parametrize("seed", range(20))
def test_random_layouts_tile_and_never_mix_a_large_tensor(seed: int) -> None:
    rng = random.Random(seed)
    bucket = rng.choice([64 * 1024, MIB, 3 * MIB + 7, 16 * MIB])
    tensors, position = [], 0
    for _ in range(rng.randint(1, 60)):
        position += rng.choice([0, 0, 0, rng.randint(1, 5000)])  # a few holes
        size = rng.choice([0, rng.randint(1, 4096), rng.randint(1, 3 * PACK_BELOW_BYTES)])
        tensors.append((position, position + size))
        position += size
    data_bytes = position + rng.choice([0, rng.randint(1, 10_000)])
    spans = broadcast_spans(tensors, data_bytes, bucket)
    _check_tiling(spans, data_bytes, bucket)
    large = [(b, e) for b, e in tensors if e - b >= min(PACK_BELOW_BYTES, bucket)]
    for begin, end in spans:
        for tensor_begin, tensor_end in large:
            if begin < tensor_end and tensor_begin < end:  # overlaps a large tensor: inside it
                assert tensor_begin <= begin and end <= tensor_end


def test_a_contiguous_sender_broadcasts_plain_bucket_slices_across_tensors() -> None:
    tensors = [(0, 100), (100, 300 + 9 * MIB), (300 + 9 * MIB, 400 + 9 * MIB)]
    spans = broadcast_spans(tensors, 400 + 9 * MIB, 4 * MIB, contiguous=True)
    assert spans == [(0, 4 * MIB), (4 * MIB, 8 * MIB), (8 * MIB, 400 + 9 * MIB)]
    _check_tiling(spans, 400 + 9 * MIB, 4 * MIB)
    assert broadcast_spans([], 0, MIB, contiguous=True) == []


def test_buckets_too_small_for_the_file_are_refused() -> None:
    with pytest.raises(ValueError, match="larger buckets"):
        broadcast_spans([(0, MAX_BROADCASTS * 2 + 1)], MAX_BROADCASTS * 2 + 1, 1)
    with pytest.raises(ValueError, match="larger buckets"):
        broadcast_spans([], MAX_BROADCASTS * 8 + 8, 4, contiguous=True)
    spans = broadcast_spans([], MAX_BROADCASTS * 4, 4, contiguous=True)  # exactly the most
    assert len(spans) == MAX_BROADCASTS
