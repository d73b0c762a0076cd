"""The names of UpdateWeights' data planes, written once for trainer, server and replies.

A trainer asks for a transport (`update_weights(transport=...)`), a server accepts some
(--weight-transports, Health.weight_transports) and names the one that carried an update in
UpdateWeightsResponse.transport.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

__all__ = [
    "AUTO",
    "CLIENT_TRANSPORTS",
    "CUDA_IPC",
    "DIST",
    "GRPC",
    "GRPC_PARALLEL",
    "REPLY_TRANSPORTS",
    "SHM",
    "SOURCE_TRANSPORTS",
    "WEIGHT_TRANSPORTS",
]

GRPC = "grpc"  # chunks on the UpdateWeights stream
GRPC_PARALLEL = "grpc-parallel"  # chunks on several UpdateWeights streams, a byte range each
SHM = "shm"  # a sealed memfd of a trainer on the server's host
DIST = "dist"  # a torch.distributed broadcast to a weights group
CUDA_IPC = "cuda_ipc"  # CUDA memory of a trainer on the server's host, opened by CUDA IPC
# The trainer's choice: CUDA_IPC for CUDA tensors, else SHM, on the server's host; else GRPC.
AUTO = "auto"

# What a server may accept (--weight-transports); GRPC is always on, CUDA_IPC only on CUDA.
WEIGHT_TRANSPORTS: tuple[str, ...] = (GRPC, SHM, DIST, CUDA_IPC)
# What a trainer may ask for.
CLIENT_TRANSPORTS: tuple[str, ...] = (AUTO, GRPC, SHM, DIST, CUDA_IPC)
# What a reply may name: the plane that carried the update.
REPLY_TRANSPORTS: tuple[str, ...] = (GRPC, GRPC_PARALLEL, SHM, DIST, CUDA_IPC)
# WeightsHeader's `source` oneof -> the transport it is.
SOURCE_TRANSPORTS: Mapping[str, str] = MappingProxyType(
    {"shared_memory": SHM, "distributed": DIST, "cuda_ipc": CUDA_IPC}
)
