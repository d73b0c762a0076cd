"""Page-locking shared-memory mappings (client/protocol/page_lock.py): on CUDA a mapping becomes
memory torch copies from or to by DMA (the server's read-only mapping of a client's file, the
client's own writable one); anywhere else nothing changes."""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from rollserve.client.protocol.page_lock import (
    host_tensor,
    register_host_range,
    unregister_host_range,
)
from rollserve.client.weights.shared_memory import SharedMemoryFile


@pytest.fixture
def read_only_mapping() -> Iterator[mmap.mmap]:
    """A memfd of 3 MiB + 5 bytes of known bytes, mapped read-only as the server maps one."""
    fd = os.memfd_create("page-lock-test")
    payload = (np.arange(3 * (1 << 20) + 5) % 251).astype(np.uint8)
    os.write(fd, payload.tobytes())
    mapping = mmap.mmap(fd, len(payload), prot=mmap.PROT_READ)
    os.close(fd)
    yield mapping
    mapping.close()  # raises BufferError if a test left a view of it alive


def test_off_cuda_nothing_is_registered(read_only_mapping: mmap.mmap) -> None:
    array = np.frombuffer(read_only_mapping, dtype=np.uint8)
    assert not register_host_range(array, torch.device("cpu"), read_only=True)
    tensor = host_tensor(array)
    assert not tensor.is_pinned()
    assert tensor.data_ptr() == array.ctypes.data  # a view, never a copy
    assert int(tensor[1000]) == 1000 % 251
    del tensor, array


@pytest.mark.gpu
def test_a_registered_mapping_is_copied_asynchronously_and_unregistered(
    read_only_mapping: mmap.mmap,
) -> None:
    device = torch.device("cuda")
    array = np.frombuffer(read_only_mapping, dtype=np.uint8)
    assert register_host_range(array, device, read_only=True)
    try:
        source = host_tensor(array)
        assert source.is_pinned()
        target = torch.empty(source.shape, dtype=torch.uint8, device=device)
        stream = torch.cuda.Stream(device)
        with torch.cuda.stream(stream):
            target.copy_(source, non_blocking=True)
        stream.synchronize()
        assert torch.equal(target.cpu(), source)
    finally:
        unregister_host_range(array, device)
    assert not host_tensor(array).is_pinned()
    torch.zeros(1, device=device).add_(1)  # no error left behind for the next kernel
    torch.cuda.synchronize(device)
    del source, target, array


def _file_bytes(file: SharedMemoryFile, total: int) -> bytes:
    with open(f"/proc/self/fd/{file.fd}", "rb") as handle:
        return handle.read(total)


def test_a_client_file_of_cpu_tensors_is_not_page_locked() -> None:
    tensors = [(0, torch.arange(1000, dtype=torch.float32)), (4000, torch.ones(7))]
    file = SharedMemoryFile()
    try:
        file.write(b"head", tensors)
        assert not file.page_locked
        want = b"head" + b"".join(t.numpy().tobytes() for _, t in tensors)
        assert _file_bytes(file, len(want)) == want
    finally:
        file.close()


@pytest.mark.gpu
def test_a_client_file_of_cuda_tensors_is_page_locked_and_exact() -> None:
    device = torch.device("cuda")
    first = torch.randn(1 << 20, device=device)
    second = torch.randn(3, 5, device=device).to(torch.bfloat16)
    tensors = [(0, first), (first.numel() * 4, second)]
    file = SharedMemoryFile()
    try:
        for _ in range(2):  # the second write reuses the mapping and its registration
            file.write(b"head", tensors)
            assert file.page_locked
            want = (
                b"head"
                + first.cpu().numpy().tobytes()
                + second.cpu().view(torch.int16).numpy().tobytes()
            )
            assert _file_bytes(file, len(want)) == want
    finally:
        file.close()
    assert not file.page_locked
