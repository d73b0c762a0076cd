"""The client's shared-memory writer (client/weights/shared_memory.py): tensors copied into the
memfd in file order by a few threads, small ones grouped into one task, and `written(end)` only
ever reporting a prefix of the file that is already final."""

from __future__ import annotations

import pytest
import torch
from rollserve.client.weights import shared_memory
from rollserve.client.weights.shared_memory import SharedMemoryFile


def _file_bytes(file: SharedMemoryFile, total: int) -> bytes:
    with open(f"/proc/self/fd/{file.fd}", "rb") as handle:
        return handle.read(total)


@pytest.mark.parametrize("piece_bytes", [64, 1000, 1 << 20])
def test_every_reported_prefix_is_final_and_the_file_is_exact(
    monkeypatch: pytest.MonkeyPatch, piece_bytes: int
) -> None:
    # Many tiny tensors (a model's norms and biases), some larger than a piece (sliced) and an
    # empty one; piece sizes from "every tensor its own task" to "everything in one".
    monkeypatch.setattr(shared_memory, "_WRITE_PIECE_BYTES", piece_bytes)
    torch.manual_seed(0)
    sizes = [3, 1, 40, 0, 7, 300, 2, 2, 90, 1, 5, 16, 1000, 3]
    tensors, offset = [], 0
    for size in sizes:
        tensors.append((offset, torch.randn(size)))
        offset += 4 * size
    head = b"head-bytes"
    want = head + b"".join(t.numpy().tobytes() for _, t in tensors)
    file = SharedMemoryFile()
    try:
        for _ in range(2):  # the second write reuses the memfd: stale bytes must not count
            ends: list[int] = []

            def written(end: int, ends: list[int] = ends, want: bytes = want) -> None:
                # What the server would copy now: it must already be the file's bytes.
                assert _file_bytes(file, end) == want[:end], f"prefix {end} not final"
                ends.append(end)

            file.write(head, tensors, written=written)
            assert ends == sorted(ends) and ends[0] >= len(head) and ends[-1] == len(want)
            assert _file_bytes(file, len(want)) == want
            tensors = [(o, t * -1) for o, t in tensors]
            want = head + b"".join(t.numpy().tobytes() for _, t in tensors)
    finally:
        file.close()


def test_small_tensors_share_a_task() -> None:
    tiny = [(4 * i, torch.ones(1)) for i in range(200)]
    batches = shared_memory._batches([(begin, t.numpy()) for begin, t in tiny])
    assert len(batches) == 1 and [p[0] for p in batches[0]] == [b for b, _ in tiny]


def test_a_device_tensor_is_written_in_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    # A GPU tensor's bytes go in _WRITE_PIECE_BYTES slices (so that the server copies the first
    # to its device while the next leave the trainer's): here a "meta" tensor stands in for
    # the device (no bytes needed to check offsets and sizes).
    monkeypatch.setattr(shared_memory, "_WRITE_PIECE_BYTES", 1000)
    tensor = torch.empty(3, 1001, dtype=torch.bfloat16, device="meta")  # 6,006 bytes
    pieces = shared_memory._pieces(64, tensor)
    assert [begin for begin, _ in pieces] == [64 + 1000 * i for i in range(7)]
    assert [piece.nbytes for _, piece in pieces] == [1000] * 6 + [6]
    assert all(isinstance(p, torch.Tensor) and p.dtype == torch.uint8 for _, p in pieces)
    assert all(p.device.type == "meta" for _, p in pieces)
    assert shared_memory._pieces(0, torch.empty(0, device="meta")) == []


def test_the_writing_threads_follow_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # ROLLSERVE_SHM_WRITE_THREADS is read at each write (a trainer or a bench may change it
    # between updates); the file is exact whatever the count; a value that is not 1 to 64 is a
    # ValueError naming the variable, not a silent default.
    monkeypatch.setattr(shared_memory, "_WRITE_PIECE_BYTES", 64)
    tensors = [(400 * i, torch.full((100,), float(i))) for i in range(16)]  # 16 pieces or more
    want = b"h" + b"".join(t.numpy().tobytes() for _, t in tensors)
    file = SharedMemoryFile()
    pools = []
    try:
        for threads in ("2", "3", "3", ""):
            if threads:
                monkeypatch.setenv(shared_memory.WRITE_THREADS_ENV, threads)
            else:
                monkeypatch.delenv(shared_memory.WRITE_THREADS_ENV, raising=False)
            file.write(b"h", tensors)
            assert _file_bytes(file, len(want)) == want
            expected = int(threads) if threads else shared_memory.write_threads()
            assert file._pool is not None and file._pool._max_workers == expected
            pools.append(file._pool)
        assert pools[0] is not pools[1] and pools[1] is pools[2]  # kept while the count holds
        for bad in ("0", "65", "four", "-1"):
            monkeypatch.setenv(shared_memory.WRITE_THREADS_ENV, bad)
            with pytest.raises(ValueError, match=shared_memory.WRITE_THREADS_ENV):
                file.write(b"h", tensors)
    finally:
        file.close()
