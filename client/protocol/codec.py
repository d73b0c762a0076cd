"""The tensor codec: torch tensors <-> `rollserve.v1.Tensor` {dtype, shape, little-endian bytes}.

Encoding makes one host copy (device tensors first come to the CPU). Decoding validates dtype,
shape and byte length before it touches the data, then wraps the received bytes without copying.
"""

from __future__ import annotations

import math
import sys
import threading
import warnings
from collections.abc import Iterable

import torch
from google.protobuf.message import Message

from ...v1 import rollout_pb2 as pb
from .dtypes import TORCH_DTYPES, WIRE_DTYPES
from .errors import TensorCodecError

__all__ = [
    "MAX_ELEMENTS",
    "MAX_NDIM",
    "torch_dtype",
    "wire_dtype",
    "encode_tensor",
    "encode_tensor_into",
    "decode_tensor",
    "decode_optional",
]

# Bounds checked before any allocation. numpy's rank limit; 2**48 elements keeps every stride
# torch computes (even for an empty tensor such as (0, 2**40, 2**40)) far inside int64, and is
# far above anything a protobuf message (< 2 GiB) can carry, so no real tensor is refused.
MAX_NDIM = 64
MAX_ELEMENTS = 2**48

_LITTLE_ENDIAN_HOST = sys.byteorder == "little"


def torch_dtype(wire: int, *, name: str = "tensor") -> torch.dtype:
    """The torch dtype of a wire DType value; TensorCodecError for UNSPECIFIED or unknown values."""
    dtype = TORCH_DTYPES.get(wire)
    if dtype is None:
        # proto3 enums are open: an unknown number (say 99) arrives intact, so name it.
        label = "DTYPE_UNSPECIFIED" if wire == pb.DTYPE_UNSPECIFIED else f"unknown value {wire}"
        raise TensorCodecError(f"{name}: dtype {label} is not a valid tensor dtype")
    return dtype


def wire_dtype(dtype: torch.dtype, *, name: str = "tensor") -> int:
    """The wire DType value of a torch dtype; TensorCodecError for dtypes the wire lacks."""
    wire = WIRE_DTYPES.get(dtype)
    if wire is None:
        supported = ", ".join(str(d).removeprefix("torch.") for d in WIRE_DTYPES)
        raise TensorCodecError(f"{name}: dtype {dtype} cannot be encoded (supported: {supported})")
    return wire


# ------------------------------------------------------------------------------------------
# Encoding
# ------------------------------------------------------------------------------------------


def encode_tensor(t: torch.Tensor, *, name: str = "tensor") -> pb.Tensor:
    """A new `pb.Tensor` holding `t` (any device, any strides, 0-dim and empty included)."""
    msg = pb.Tensor()
    encode_tensor_into(msg, t, name=name)
    return msg


def encode_tensor_into(msg: pb.Tensor, t: torch.Tensor, *, name: str = "tensor") -> None:
    """Fill `msg` (e.g. a sub-message field such as `experience.kl`) with `t`, replacing it.

    Filling the field in place spares the second copy of the data that building a separate
    message and `CopyFrom`-ing it into the parent would make.
    """
    wire = wire_dtype(t.dtype, name=name)
    data = _little_endian_bytes(t, name=name)
    msg.dtype = wire
    del msg.shape[:]
    msg.shape.extend(t.shape)
    msg.data = data


def _little_endian_bytes(t: torch.Tensor, *, name: str) -> bytes:
    """Row-major little-endian bytes of `t`, with exactly one host copy for a CPU tensor."""
    if not isinstance(t, torch.Tensor):
        raise TensorCodecError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided or t.device.type == "meta":
        raise TensorCodecError(f"{name}: only dense tensors with data can be encoded")
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    # Lazy conjugate/negative views would make numpy refuse the tensor; no copy when unset.
    t = t.resolve_conj().resolve_neg()
    if t.dtype == torch.bfloat16:
        # numpy has no bfloat16; int16 has the same width, so the raw bits travel unchanged.
        t = t.view(torch.int16)
    if not _LITTLE_ENDIAN_HOST:
        t = _swap_byte_order(t)
    # numpy writes any strided layout straight into the new bytes in C order: the one copy.
    return t.numpy().tobytes()


def _swap_byte_order(t: torch.Tensor) -> torch.Tensor:
    """`t` with the bytes of every element reversed (big-endian hosts only; a copy)."""
    size = t.element_size()
    if size == 1:
        return t
    # An explicit format gives unit strides even where contiguous() keeps odd ones (size-1 dims).
    dense = t.clone(memory_format=torch.contiguous_format).reshape(-1)  # (numel,)
    flat = dense.view(torch.uint8).view(-1, size)  # (numel, itemsize)
    return flat.flip(1).contiguous().view(t.dtype).view(t.shape)


# ------------------------------------------------------------------------------------------
# Decoding
# ------------------------------------------------------------------------------------------


def decode_tensor(msg: pb.Tensor, *, name: str = "tensor") -> torch.Tensor:
    """The tensor in `msg`, validated, sharing memory with the received bytes (no copy).

    Raises TensorCodecError, naming `name` (e.g. "experience.action_mask"), for an unknown or
    unspecified dtype, a negative or oversized shape, or a byte length that does not match.
    The result is writable and owned by the caller: nothing else refers to its memory.
    """
    dtype = torch_dtype(msg.dtype, name=name)
    shape = _checked_shape(msg.shape, name=name)
    # Read exactly once: under upb every access builds a new bytes object (a full copy).
    data = msg.data
    return _tensor_from_bytes(data, dtype, shape, name=name, private=_field_reads_are_private())


def decode_optional(parent: Message, field: str, *, name: str | None = None) -> torch.Tensor | None:
    """Decode the Tensor field `field` of `parent`, or None when it is absent.

    A present but all-default Tensor (no dtype, shape or data) also counts as absent: the
    proto describes some optional fields as "empty if none", and dtype UNSPECIFIED could not
    be decoded anyway.
    """
    if not parent.HasField(field):
        return None
    msg = getattr(parent, field)
    if msg.ByteSize() == 0:
        return None
    return decode_tensor(msg, name=name or field)


def _checked_shape(dims: Iterable[int], *, name: str) -> tuple[int, ...]:
    """The shape as a tuple, after checking rank, signs and size without building huge ints."""
    shape = tuple(dims)
    if len(shape) > MAX_NDIM:
        raise TensorCodecError(f"{name}: {len(shape)} dimensions, more than the limit {MAX_NDIM}")
    extent = 1  # product of the dims with 0 read as 1: bounds torch's strides for empty tensors
    for d in shape:
        if d < 0:
            raise TensorCodecError(f"{name}: negative dimension {d} in shape {list(shape)}")
        extent *= max(d, 1)
        if extent > MAX_ELEMENTS:
            raise TensorCodecError(
                f"{name}: shape {list(shape)} is too large (more than 2**48 elements)"
            )
    return shape


def _tensor_from_bytes(
    data: bytes, dtype: torch.dtype, shape: tuple[int, ...], *, name: str, private: bool
) -> torch.Tensor:
    """Wrap `data` as a tensor of `dtype` and `shape` after checking its length.

    `private` says that no one else holds `data`; only then is it wrapped without a copy.
    """
    numel = math.prod(shape)
    expected_bytes = numel * dtype.itemsize
    if len(data) != expected_bytes:
        raise TensorCodecError(
            f"{name}: shape {list(shape)} of {str(dtype).removeprefix('torch.')} needs "
            f"{expected_bytes} bytes, data has {len(data)}"
        )
    if numel == 0:
        return torch.empty(shape, dtype=dtype)  # torch.frombuffer rejects empty buffers
    # CPython shares bytes objects of length 0 and 1 across the interpreter; writing through a
    # tensor into one would corrupt every user of it. Copy those (and anything not private).
    buffer: bytes | bytearray = data if private and len(data) > 1 else bytearray(data)
    # Bools are read as bytes first, to refuse values other than 0 and 1 (not valid torch bools).
    flat = _frombuffer(buffer, torch.uint8 if dtype == torch.bool else dtype)  # (numel,)
    if dtype == torch.bool:
        if int(flat.max()) > 1:
            raise TensorCodecError(f"{name}: bool data holds a byte other than 0 or 1")
        flat = flat.view(torch.bool)
    if not _LITTLE_ENDIAN_HOST:
        # The wire is little-endian; on a big-endian host swap every element (a copy).
        flat = _swap_byte_order(flat)
    return flat.view(shape)


def _frombuffer(buffer: bytes | bytearray, dtype: torch.dtype) -> torch.Tensor:
    """torch.frombuffer without its warning about read-only buffers.

    torch warns because writes through the tensor would land in the (immutable) bytes object.
    That is safe here: the bytes object was created for this decode and nothing else refers to
    it. The tensor's storage holds a reference to it, so it lives as long as the tensor.
    """
    if isinstance(buffer, bytes):
        if torch.is_warn_always_enabled():
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="The given buffer is not writable")
                return torch.frombuffer(buffer, dtype=dtype)
        # torch emits the warning once per process; the probe has already absorbed it.
        _field_reads_are_private()
    return torch.frombuffer(buffer, dtype=dtype)


_probe_lock = threading.Lock()
_probe_result: bool | None = None


def _field_reads_are_private() -> bool:
    """Whether reading a bytes field returns a new object each time (true under upb).

    Probed once per process rather than assumed: the pure-Python protobuf backend hands out the
    message's own bytes object, which must then be copied before a tensor may write into it.
    The probe also absorbs torch's once-per-process warning about read-only buffers.
    """
    global _probe_result
    if _probe_result is None:
        with _probe_lock:
            if _probe_result is None:
                probe = pb.Tensor(data=b"probe")
                private = probe.data is not probe.data
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message="The given buffer is not writable")
                    torch.frombuffer(b"probe", dtype=torch.uint8)
                _probe_result = private
    return _probe_result
