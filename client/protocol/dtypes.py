"""The tensor dtypes rollserve moves: one row each of torch dtype, wire DType, safetensors name.

Every other dtype map of the project is a view of `DTYPES`: the tensor codec (wire <-> torch),
the update file and the server's header parser (safetensors name <-> torch, safetensors name ->
wire for the manifest), and the server's --dtype (torch name -> torch).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

from ...v1 import rollout_pb2 as pb

__all__ = [
    "DTYPES",
    "ITEMSIZES",
    "PROTO_DTYPES",
    "SAFETENSORS_DTYPES",
    "SAFETENSORS_NAMES",
    "TORCH_DTYPES",
    "TORCH_NAMES",
    "WIRE_DTYPES",
    "Dtype",
]


@dataclass(frozen=True)
class Dtype:
    """One dtype under its three names."""

    torch: torch.dtype
    wire: int  # rollserve.v1.DType
    safetensors: str  # the dtype string of a safetensors header, e.g. "BF16"

    @property
    def name(self) -> str:
        """torch's name without the module: "bfloat16"."""
        return str(self.torch).removeprefix("torch.")


# Every DType of the proto except UNSPECIFIED, in the proto's order.
DTYPES: tuple[Dtype, ...] = (
    Dtype(torch.bool, pb.DTYPE_BOOL, "BOOL"),
    Dtype(torch.uint8, pb.DTYPE_UINT8, "U8"),
    Dtype(torch.int8, pb.DTYPE_INT8, "I8"),
    Dtype(torch.int16, pb.DTYPE_INT16, "I16"),
    Dtype(torch.int32, pb.DTYPE_INT32, "I32"),
    Dtype(torch.int64, pb.DTYPE_INT64, "I64"),
    Dtype(torch.float16, pb.DTYPE_FLOAT16, "F16"),
    Dtype(torch.bfloat16, pb.DTYPE_BFLOAT16, "BF16"),
    Dtype(torch.float32, pb.DTYPE_FLOAT32, "F32"),
    Dtype(torch.float64, pb.DTYPE_FLOAT64, "F64"),
)

# wire DType -> torch dtype (the tensor codec).
TORCH_DTYPES: Mapping[int, torch.dtype] = MappingProxyType({d.wire: d.torch for d in DTYPES})
# torch dtype -> wire DType.
WIRE_DTYPES: Mapping[torch.dtype, int] = MappingProxyType({d.torch: d.wire for d in DTYPES})
# wire DType -> bytes per element (fixed by the proto, equal to torch's itemsize).
ITEMSIZES: Mapping[int, int] = MappingProxyType({d.wire: d.torch.itemsize for d in DTYPES})
# safetensors dtype string -> torch dtype: the dtypes an update file may hold; others are refused.
SAFETENSORS_DTYPES: Mapping[str, torch.dtype] = MappingProxyType(
    {d.safetensors: d.torch for d in DTYPES}
)
# torch dtype -> safetensors dtype string.
SAFETENSORS_NAMES: Mapping[torch.dtype, str] = MappingProxyType(
    {d.torch: d.safetensors for d in DTYPES}
)
# safetensors dtype string -> wire DType (an update header's manifest).
PROTO_DTYPES: Mapping[str, int] = MappingProxyType({d.safetensors: d.wire for d in DTYPES})
# torch's name ("bfloat16") -> torch dtype.
TORCH_NAMES: Mapping[str, torch.dtype] = MappingProxyType({d.name: d.torch for d in DTYPES})
