"""A torch.distributed process group of its own (no global default group), for weight broadcasts.

Both sides build it the same way: a TCPStore at the trainer's address (the trainer, rank 0,
hosts it), a PrefixStore per group name, and a Gloo (CPU) or NCCL (GPU) process group over it,
like SGLang's init_weights_update_group. Nothing here touches torch.distributed's default group,
so a trainer that already runs its own torch.distributed job keeps it.
"""

from __future__ import annotations

import datetime
import logging
import socket
from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = [
    "BACKENDS",
    "BucketBuffers",
    "CONTIGUOUS_BUCKET_BYTES",
    "DEFAULT_BUCKET_BYTES",
    "MAX_BROADCASTS",
    "MAX_LANES",
    "PACK_BELOW_BYTES",
    "all_max",
    "broadcast",
    "broadcast_spans",
    "default_lanes",
    "new_process_groups",
    "shut_down",
]

_LOG = logging.getLogger(__name__)
BACKENDS = ("gloo", "nccl")
# Lanes: process groups over one rendezvous that the broadcasts of an update take in turn.
# Gloo runs one broadcast at a time per pair connection and pays a fixed cost per broadcast;
# with the ranges of a Llama (2-8 MiB each) two lanes beat one and four were no faster than two
# (bench/RESULTS.md). NCCL keeps one: it pipelines on its own.
MAX_LANES = 8


def default_lanes(backend: str) -> int:
    return 2 if backend == "gloo" else 1


def new_process_groups(
    *,
    group: str,
    master_address: str,
    master_port: int,
    world_size: int,
    rank: int,
    backend: str,
    timeout_s: float,
    lanes: int = 1,
    store: dist.Store | None = None,
) -> tuple[dist.ProcessGroup, ...]:
    """Join (rank > 0) or host (rank 0) a group as `lanes` process groups over one rendezvous
    (lane 0 is the group "{group}", lane k "{group}/lane{k}"); blocks until every rank joined
    all of them. `store`: the master store (rank 0) or a client of it already connected."""
    if not 1 <= lanes <= MAX_LANES:
        raise ValueError(f"lanes must be 1 to {MAX_LANES}, got {lanes}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "nccl" and (
        not torch.cuda.is_available() or not hasattr(dist, "ProcessGroupNCCL")
    ):
        raise RuntimeError("the nccl backend needs CUDA and a torch built with NCCL")
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(
            master_address, master_port, world_size, is_master=False, timeout=timeout
        )
    names = [group] + [f"{group}/lane{lane}" for lane in range(1, lanes)]
    return tuple(
        _process_group(
            dist.PrefixStore(f"rollserve/{name}", store),
            rank,
            world_size,
            backend,
            timeout,
            master_address,
        )  # fmt: skip
        for name in names
    )


def _process_group(
    store: dist.Store,
    rank: int,
    world_size: int,
    backend: str,
    timeout: datetime.timedelta,
    master_address: str,
) -> dist.ProcessGroup:
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        # Bind to the address that reaches the master, not whatever the hostname resolves to.
        options._devices = [
            dist.ProcessGroupGloo.create_device(hostname=_local_address(master_address))
        ]
        return dist.ProcessGroupGloo(store, rank, world_size, options)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, world_size, options)


def shut_down(process_groups: tuple[dist.ProcessGroup, ...]) -> None:
    """Shut the lanes of a group down, errors ignored (a group whose peer died may refuse even
    this). Gloo closes its connections only when a process group is destroyed (shutdown and
    abort leave them open: measured, a peer waiting in a broadcast then waits out its timeout),
    so the caller must also drop its references, as both sides do."""
    for process_group in process_groups:
        try:
            process_group.shutdown()
        except Exception:
            _LOG.debug("shutting down a weights process group failed", exc_info=True)


def _local_address(master_address: str) -> str:
    """This host's address on the route to the master (loopback for a local master)."""
    try:
        infos = socket.getaddrinfo(master_address, None, type=socket.SOCK_DGRAM)
        family, _, _, _, address = infos[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((address[0], 9))  # UDP connect sends nothing; it picks the route
            return probe.getsockname()[0]
    except OSError:
        return master_address


def broadcast(group: dist.ProcessGroup, tensor: torch.Tensor) -> None:
    """Broadcast `tensor` from rank 0 to every rank (in place on the receivers); waits."""
    group.broadcast(tensor, 0).wait()


def all_max(group: dist.ProcessGroup, value: int, device: torch.device | str = "cpu") -> int:
    """The largest of every rank's `value` (the go/no-go vote before a broadcast)."""
    flag = torch.tensor([value], dtype=torch.int64, device=device)
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.MAX
    group.allreduce([flag], options).wait()
    return int(flag.item())


# Bytes per broadcast at most. With ranges that follow the tensors (broadcast_spans), 8 MiB beat
# 4, 16 and 64 MiB (bench/RESULTS.md); with fixed ranges 16 MiB had been best.
DEFAULT_BUCKET_BYTES = 8 * 1024 * 1024
# Bytes per broadcast at most when the sender's data section is one run (contiguous spans).
CONTIGUOUS_BUCKET_BYTES = 32 * 1024 * 1024
# Broadcasts per update at most: each has a fixed cost, and both sides list them first, so a
# tiny bucket_bytes for a large file (1 byte: 5e8 broadcasts for 0.5 GB) is refused rather than
# taken for minutes and GBs. 140 GB in 1 MiB buckets is 1.3e5.
MAX_BROADCASTS = 1 << 18
# Tensors smaller than this share a broadcast with their neighbours (one fill copy on the
# sender); larger ones go alone, from their own memory.
PACK_BELOW_BYTES = 1 << 20


def broadcast_spans(
    tensors: Sequence[tuple[int, int]],
    data_bytes: int,
    bucket_bytes: int,
    *,
    contiguous: bool = False,
) -> list[tuple[int, int]]:
    """The data-section byte ranges [begin, end) that rank 0 broadcasts, in order; every rank
    computes them from the file's header (tensors: each tensor's [begin, end), in data order)
    and DistributedSource.contiguous.

    A range never holds part of a large tensor together with anything else: a tensor of at
    least PACK_BELOW_BYTES goes in bucket_bytes pieces of its own, sent from the trainer's
    tensor and received straight into the arena, with no copy on either side. Runs of smaller
    tensors (and any bytes between tensors) are packed into ranges of at most bucket_bytes,
    which the sender fills into a buffer. Fixed buckets over the whole section made the
    trainer copy every bucket that crossed a tensor boundary: most of a Llama's bytes.

    Contiguous: rank 0 holds the whole data section as one run of memory (flat_weights.py), so
    the ranges are plain bucket_bytes slices of it: no copy on either side, and the fewest,
    largest broadcasts (gloo pays a fixed cost per broadcast).
    """
    if data_bytes // bucket_bytes > MAX_BROADCASTS:  # at least that many ranges, either way
        raise ValueError(
            f"{bucket_bytes} bytes per broadcast make over {MAX_BROADCASTS} broadcasts of "
            f"{data_bytes} bytes; use larger buckets"
        )
    if contiguous:
        return [
            (begin, min(begin + bucket_bytes, data_bytes))
            for begin in range(0, data_bytes, bucket_bytes)
        ]
    pack_below = min(PACK_BELOW_BYTES, bucket_bytes)
    spans: list[tuple[int, int]] = []
    pack: list[int] = []  # [begin, end] of the small run being packed

    def flush() -> None:
        if pack:
            spans.append((pack[0], pack[1]))
            pack.clear()

    def small(begin: int, end: int) -> None:
        for piece in range(begin, end, bucket_bytes):  # one piece unless a gap is that large
            piece_end = min(piece + bucket_bytes, end)
            if pack and piece_end - pack[0] <= bucket_bytes:
                pack[1] = piece_end
            else:
                flush()
                pack.extend((piece, piece_end))

    position = 0
    for begin, end in sorted(tensors):
        if begin > position:
            small(position, begin)  # bytes between tensors travel like a small tensor
        if end - begin < pack_below:
            if end > begin:
                small(begin, end)
        else:
            flush()
            pieces = range(begin, end, bucket_bytes)
            spans.extend((piece, min(piece + bucket_bytes, end)) for piece in pieces)
        position = max(position, end)
    if data_bytes > position:
        small(position, data_bytes)
    flush()
    return spans


class BucketBuffers:
    """`count` buffers of bucket_bytes taken in turn by the broadcasts in flight (index i gets
    buffer i % count), each allocated when first taken: the trainer's fill buffers for packed
    ranges, a server's bounce buffers for receives that cannot land in its arena."""

    def __init__(self, bucket_bytes: int, device: torch.device, *, count: int) -> None:
        self._bucket_bytes = bucket_bytes
        self._device = device
        self._buffers: list[torch.Tensor | None] = [None] * count

    def take(self, index: int) -> torch.Tensor:
        slot = index % len(self._buffers)
        buffer = self._buffers[slot]
        if buffer is None:
            buffer = torch.empty(self._bucket_bytes, dtype=torch.uint8, device=self._device)
            self._buffers[slot] = buffer
        return buffer
