"""Page-locking a read-only shared-memory mapping (server/weights/page_lock.py): on CUDA the
mapping becomes memory torch copies from asynchronously; anywhere else nothing changes."""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from rollserve.server.weights.page_lock import (
    host_tensor,
    register_host_range,
    unregister_host_range,
)


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
    assert not register_host_range(array, torch.device("cpu"))
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
    assert register_host_range(array, device)
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
