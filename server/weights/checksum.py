"""CRC-32 (the zlib polynomial, as WeightsChunk.crc32 specifies) of received chunk data.

zlib's table-driven CRC-32 runs at about 3.5 GiB/s per core here, i.e. ~0.3 CPU-s per GiB
received, a third of what gRPC itself costs on a 2-core server (reference/transport.md). ISA-L's
carry-less-multiply CRC-32 computes the same function 3-4x faster; it is used when the optional
`isal` package is installed, and zlib otherwise. Both give identical values for every input.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["CRC32_IMPLEMENTATION", "crc32"]

crc32: Callable[[bytes | memoryview], int]
try:
    from isal.isal_zlib import crc32  # type: ignore[no-redef]

    CRC32_IMPLEMENTATION = "isal"
except ImportError:  # the optional accelerator is absent: the standard library's
    from zlib import crc32  # type: ignore[no-redef,assignment]

    CRC32_IMPLEMENTATION = "zlib"
