"""The tensor codec: bit-exact round trips through the wire, strict validation, no-copy decode."""

from __future__ import annotations

import ctypes
import gc
import json
import os
import struct
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest
import safetensors.torch
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rollserve.client.protocol import codec
from rollserve.client.protocol.codec import (
    decode_optional,
    decode_tensor,
    encode_tensor,
    encode_tensor_into,
    torch_dtype,
    wire_dtype,
)
from rollserve.client.protocol.dtypes import (
    DTYPES,
    ITEMSIZES,
    PROTO_DTYPES,
    SAFETENSORS_DTYPES,
    SAFETENSORS_NAMES,
    TORCH_DTYPES,
    TORCH_NAMES,
    WIRE_DTYPES,
)
from rollserve.client.protocol.errors import InvalidArgument, TensorCodecError
from rollserve.v1 import rollout_pb2 as pb

ALL_DTYPES = list(WIRE_DTYPES)


def wire_round_trip(t: torch.Tensor) -> torch.Tensor:
    """Encode, serialize, parse and decode, as a tensor travels between two processes."""
    wire = encode_tensor(t).SerializeToString()
    return decode_tensor(pb.Tensor.FromString(wire), name="t")


def raw_bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of `t` in C order: compares NaN payloads, -0.0 and bf16 exactly."""
    return t.clone(memory_format=torch.contiguous_format).reshape(-1).view(torch.uint8)


def assert_bit_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    assert got.device.type == "cpu"
    assert torch.equal(raw_bits(got), raw_bits(want.cpu()))


# ------------------------------------------------------------------------------------------
# dtype table
# ------------------------------------------------------------------------------------------


def test_dtype_table_covers_every_proto_dtype_with_its_itemsize() -> None:
    named = {v for v in pb.DType.values() if v != pb.DTYPE_UNSPECIFIED}
    assert set(TORCH_DTYPES) == named and len(ALL_DTYPES) == 10
    # The proto's comments fix the widths; they must agree with torch's.
    expected = {
        "BOOL": 1,
        "UINT8": 1,
        "INT8": 1,
        "INT16": 2,
        "INT32": 4,
        "INT64": 8,
        "FLOAT16": 2,
        "BFLOAT16": 2,
        "FLOAT32": 4,
        "FLOAT64": 8,
    }
    for short, size in expected.items():
        wire = pb.DType.Value(f"DTYPE_{short}")
        assert ITEMSIZES[wire] == size == TORCH_DTYPES[wire].itemsize
        assert wire_dtype(TORCH_DTYPES[wire]) == wire
        assert torch_dtype(wire) == TORCH_DTYPES[wire]


def test_every_dtype_view_reads_the_one_table_and_safetensors_agrees() -> None:
    for dtype in DTYPES:
        # safetensors' own writer names each dtype as the table does.
        header = safetensors.torch.save({"t": torch.zeros(1, dtype=dtype.torch)})
        length = int.from_bytes(header[:8], "little")
        assert json.loads(header[8 : 8 + length])["t"]["dtype"] == dtype.safetensors
        assert SAFETENSORS_DTYPES[dtype.safetensors] is dtype.torch
        assert SAFETENSORS_NAMES[dtype.torch] == dtype.safetensors
        assert PROTO_DTYPES[dtype.safetensors] == dtype.wire == WIRE_DTYPES[dtype.torch]
        assert TORCH_NAMES[dtype.name] is dtype.torch is getattr(torch, dtype.name)


@pytest.mark.parametrize(
    "dtype", [torch.complex64, torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn]
)
def test_unsupported_dtype_is_refused(dtype: torch.dtype) -> None:
    with pytest.raises(TensorCodecError, match="policy.w"):
        encode_tensor(torch.zeros(3, dtype=dtype), name="policy.w")


def test_sparse_and_meta_tensors_are_refused() -> None:
    with pytest.raises(TensorCodecError):
        encode_tensor(torch.eye(3).to_sparse())
    with pytest.raises(TensorCodecError):
        encode_tensor(torch.empty(3, device="meta"))


# ------------------------------------------------------------------------------------------
# Round trips (property tests)
# ------------------------------------------------------------------------------------------

shapes = st.lists(st.integers(0, 5), min_size=0, max_size=4).map(tuple)


@st.composite
def tensors(draw: st.DrawFn, shape_strategy: st.SearchStrategy = shapes) -> torch.Tensor:
    """Any dtype and shape with arbitrary bit patterns: every NaN payload, inf, full int range."""
    dtype = draw(st.sampled_from(ALL_DTYPES))
    shape = draw(shape_strategy)
    numel = int(np.prod(shape)) if shape else 1
    if dtype == torch.bool:
        raw = bytes(draw(st.lists(st.integers(0, 1), min_size=numel, max_size=numel)))
    else:
        raw = draw(st.binary(min_size=numel * dtype.itemsize, max_size=numel * dtype.itemsize))
    flat = (
        torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        if raw
        else torch.empty(0, dtype=torch.uint8)
    )
    return flat.view(dtype).reshape(shape)


@settings(max_examples=300, deadline=None)
@given(tensors())
def test_round_trip_is_bit_exact(t: torch.Tensor) -> None:
    assert_bit_equal(wire_round_trip(t), t)


@st.composite
def strided_views(draw: st.DrawFn) -> torch.Tensor:
    """Non-contiguous views: permutations, step slices, offsets and stride-0 broadcasts."""
    base = draw(tensors(st.lists(st.integers(1, 5), min_size=1, max_size=4).map(tuple)))
    kind = draw(st.sampled_from(["permute", "step", "offset", "expand"]))
    if kind == "permute":
        return base.permute(*draw(st.permutations(range(base.ndim))))
    if kind == "step":
        steps = [draw(st.integers(1, 3)) for _ in range(base.ndim)]
        return base[tuple(slice(None, None, k) for k in steps)]
    if kind == "offset":
        return base[tuple(slice(draw(st.integers(0, n)), None) for n in base.shape)]
    return base.unsqueeze(0).expand(draw(st.integers(0, 3)), *base.shape)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(strided_views())
def test_round_trip_of_non_contiguous_views(t: torch.Tensor) -> None:
    assert_bit_equal(wire_round_trip(t), t)


@settings(max_examples=100, deadline=None)
@given(strided_views())
def test_wire_bytes_are_little_endian_row_major(t: torch.Tensor) -> None:
    # numpy is an independent oracle for the layout (bf16 has no numpy type: use its bits).
    arr = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()
    want = np.ascontiguousarray(arr).astype(arr.dtype.newbyteorder("<")).tobytes()
    assert encode_tensor(t).data == want


def test_known_wire_bytes() -> None:
    t = torch.arange(6, dtype=torch.int32).reshape(2, 3).T  # (3, 2), non-contiguous
    msg = encode_tensor(t)
    assert msg.dtype == pb.DTYPE_INT32 and list(msg.shape) == [3, 2]
    assert msg.data == struct.pack("<6i", 0, 3, 1, 4, 2, 5)
    assert encode_tensor(torch.tensor(1.0, dtype=torch.bfloat16)).data == b"\x80\x3f"
    assert encode_tensor(torch.tensor([1.0, -2.0], dtype=torch.float16)).data == struct.pack(
        "<2e", 1.0, -2.0
    )
    assert encode_tensor(torch.tensor([True, False])).data == b"\x01\x00"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_special_float_values_survive(dtype: torch.dtype) -> None:
    t = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e-30], dtype=dtype)
    back = wire_round_trip(t)
    assert_bit_equal(back, t)
    assert torch.signbit(back[3]) and torch.isnan(back[0]) and torch.isinf(back[1:3]).all()


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64])
def test_integer_extremes_survive(dtype: torch.dtype) -> None:
    info = torch.iinfo(dtype)
    t = torch.tensor([info.min, info.max, 0, -1 if info.min < 0 else 1], dtype=dtype)
    assert_bit_equal(wire_round_trip(t), t)


def test_zero_dim_and_empty_tensors() -> None:
    for t in [
        torch.tensor(3.5),
        torch.tensor(True),
        torch.zeros(0),
        torch.zeros(2, 0, 3, dtype=torch.int64),
    ]:
        msg = encode_tensor(t)
        assert list(msg.shape) == list(t.shape)
        assert_bit_equal(wire_round_trip(t), t)
    assert list(encode_tensor(torch.tensor(1)).shape) == []  # empty shape = 0-dim scalar


def test_encode_detaches_and_replaces_previous_content() -> None:
    t = torch.randn(4, requires_grad=True)
    msg = encode_tensor(torch.zeros(2, 2, dtype=torch.int64))
    encode_tensor_into(msg, t * 2)
    assert msg.dtype == pb.DTYPE_FLOAT32 and list(msg.shape) == [4]
    assert_bit_equal(decode_tensor(msg), (t * 2).detach())


def test_decoded_tensor_is_writable_and_independent() -> None:
    msg = encode_tensor(torch.arange(10, dtype=torch.int64))
    first, second = decode_tensor(msg), decode_tensor(msg)
    first[0] = 99
    assert second[0] == 0 and decode_tensor(msg)[0] == 0  # writes never reach the message
    one = decode_tensor(encode_tensor(torch.tensor([7], dtype=torch.uint8)))
    one[0] = 8  # a 1-byte payload is a CPython-shared bytes object: it must have been copied
    assert (
        bytes([7]) == b"\x07"
        and decode_tensor(encode_tensor(torch.tensor([7], dtype=torch.uint8)))[0] == 7
    )


# ------------------------------------------------------------------------------------------
# Malformed input
# ------------------------------------------------------------------------------------------


def _raw(dtype: int, shape: list[int], data: bytes) -> pb.Tensor:
    msg = pb.Tensor(dtype=dtype, shape=shape, data=data)
    return pb.Tensor.FromString(msg.SerializeToString())


MALFORMED = {
    "unspecified dtype": (_raw(pb.DTYPE_UNSPECIFIED, [2], b"\0\0"), "DTYPE_UNSPECIFIED"),
    "unknown dtype 99": (_raw(99, [2], b"\0\0"), "unknown value 99"),
    "negative dim": (_raw(pb.DTYPE_UINT8, [2, -1], b""), "negative dimension -1"),
    "overflowing dims": (_raw(pb.DTYPE_FLOAT32, [2**40, 2**40], b"\0" * 16), "too large"),
    "empty but overflowing": (_raw(pb.DTYPE_FLOAT32, [0, 2**40, 2**40], b""), "too large"),
    "int64 max dims": (_raw(pb.DTYPE_INT8, [2**63 - 1, 2**63 - 1], b""), "too large"),
    "too many dims": (_raw(pb.DTYPE_UINT8, [1] * 65, b"\0"), "dimensions"),
    "too few bytes": (_raw(pb.DTYPE_FLOAT32, [2, 3], b"\0" * 23), "needs 24 bytes, data has 23"),
    "too many bytes": (_raw(pb.DTYPE_FLOAT32, [2, 3], b"\0" * 25), "needs 24 bytes, data has 25"),
    "bytes for an empty tensor": (_raw(pb.DTYPE_INT64, [3, 0], b"\0" * 8), "needs 0 bytes"),
    "scalar without bytes": (_raw(pb.DTYPE_INT64, [], b""), "needs 8 bytes, data has 0"),
    "bool byte 2": (_raw(pb.DTYPE_BOOL, [3], b"\x01\x02\x00"), "0 or 1"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_tensor_is_rejected_with_a_named_error(case: str) -> None:
    msg, fragment = MALFORMED[case]
    result = None
    with pytest.raises(TensorCodecError) as excinfo:
        result = decode_tensor(msg, name="experience.action_mask")
    assert result is None
    assert isinstance(excinfo.value, InvalidArgument)  # travels as INVALID_ARGUMENT
    assert "experience.action_mask" in str(excinfo.value)
    assert fragment in str(excinfo.value)


def test_decode_optional_maps_unset_and_empty_fields_to_none() -> None:
    exp = pb.Experience()
    assert decode_optional(exp, "values") is None
    exp.values.SetInParent()  # present but all-default: "empty if none"
    assert exp.HasField("values") and decode_optional(exp, "values") is None
    encode_tensor_into(exp.values, torch.ones(2, 3))
    assert_bit_equal(decode_optional(exp, "values"), torch.ones(2, 3))
    exp.values.dtype = 99
    with pytest.raises(TensorCodecError, match="experience.values"):
        decode_optional(exp, "values", name="experience.values")


# ------------------------------------------------------------------------------------------
# No copy on decode
# ------------------------------------------------------------------------------------------


def test_decode_wraps_the_received_bytes_without_copying() -> None:
    data = bytes(range(256)) * 64
    t = codec._tensor_from_bytes(data, torch.float32, (64, 64), name="t", private=True)
    payload = ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value
    assert t.data_ptr() == payload  # the tensor's memory is the bytes object's own buffer


def test_decode_tensor_keeps_the_message_bytes_alive_instead_of_copying() -> None:
    # The bytes object that decode reads from the message (Python-allocated, so traced) must be
    # what the tensor holds: alive while the tensor lives, freed with it, and never a second
    # buffer beside it. A decode that copied into torch's (untraced) allocator would free it on
    # return; one that copied into another Python buffer would double the peak.
    nbytes = 4 << 20
    msg = pb.Tensor.FromString(encode_tensor(torch.ones(nbytes // 4)).SerializeToString())
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        t = decode_tensor(msg)
        held, peak = (m - before for m in tracemalloc.get_traced_memory())
        assert t.shape == (nbytes // 4,) and bool((t == 1).all())
        del t
        gc.collect()
        released = held - (tracemalloc.get_traced_memory()[0] - before)
    finally:
        tracemalloc.stop()
    # tracemalloc counts every thread's Python allocations: threads left by earlier tests may
    # allocate a few bytes in the window, so `released` gets a slack far below the 4 MiB buffer.
    slack = 64 << 10
    assert held >= nbytes
    assert peak < 1.5 * nbytes
    assert released >= nbytes - slack


def test_decode_emits_no_warning() -> None:
    # torch warns once per process about read-only buffers; a fresh interpreter with warnings
    # turned into errors shows that the codec absorbs it.
    code = (
        "import torch; from rollserve.client.protocol.codec import encode_tensor, decode_tensor\n"
        "t = decode_tensor(encode_tensor(torch.arange(100)))\n"
        "assert int(t.sum()) == 4950\n"
    )
    subprocess.run([sys.executable, "-W", "error", "-c", code], check=True, timeout=120)


def test_writes_never_reach_the_message_under_the_pure_python_protobuf() -> None:
    # That backend returns the message's own bytes object on every read, so the codec must
    # copy there; under upb (the default) each read is a fresh private object.
    code = (
        "import torch; from rollserve.client.protocol.codec import encode_tensor, decode_tensor\n"
        "from google.protobuf.internal import api_implementation\n"
        "assert api_implementation.Type() == 'python'\n"
        "msg = encode_tensor(torch.arange(10))\n"
        "decode_tensor(msg)[0] = 99\n"
        "assert int(decode_tensor(msg)[0]) == 0\n"
    )
    env = {**os.environ, "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": "python"}
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, env=env)


def test_byte_swap_for_big_endian_hosts_reverses_each_element() -> None:
    # Only runs for real on big-endian hosts; check the helper against numpy's byteswap here.
    t = torch.arange(-6, 6, dtype=torch.int32).reshape(3, 4).T
    swapped = codec._swap_byte_order(t)
    assert swapped.numpy().tobytes() == np.ascontiguousarray(t.numpy()).byteswap().tobytes()
    assert_bit_equal(codec._swap_byte_order(swapped), t)
    bf = torch.tensor([1.0, -2.5], dtype=torch.bfloat16)
    assert raw_bits(codec._swap_byte_order(bf)).tolist() == [0x3F, 0x80, 0xC0, 0x20]


@pytest.mark.gpu
def test_cuda_tensor_encodes_like_its_cpu_copy() -> None:
    t = torch.randn(33, 17, device="cuda").T
    assert encode_tensor(t).data == encode_tensor(t.cpu()).data
    assert_bit_equal(wire_round_trip(t.to(torch.bfloat16)), t.to(torch.bfloat16).cpu())
