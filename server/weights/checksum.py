"""CRC-32 (the zlib polynomial, as WeightsChunk.crc32 specifies) of received chunk data.

One implementation for both sides: ISA-L when the optional `isal` package is importable, zlib
otherwise (identical values); see rollserve.client.protocol.wire for the costs.
"""

from __future__ import annotations

from ...client.protocol.wire import CRC32_IMPLEMENTATION, crc32

__all__ = ["CRC32_IMPLEMENTATION", "crc32"]
