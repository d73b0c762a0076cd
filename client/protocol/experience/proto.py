"""Experience <-> rollserve.v1.Experience: each tensor field as {dtype, shape, raw bytes}."""

from __future__ import annotations

import torch

from ....v1 import rollout_pb2 as pb
from ..codec import decode_optional, decode_tensor, encode_tensor_into
from ..errors import InvalidArgument
from .fields import EXPERIENCE_SPECS
from .records import Experience

__all__ = ["experience_from_proto", "experience_to_proto"]


def experience_to_proto(e: Experience) -> pb.Experience:
    """The wire form of `e`; None fields stay unset."""
    msg = pb.Experience()
    for spec in EXPERIENCE_SPECS:
        t = getattr(e, spec.name)
        if t is not None:
            encode_tensor_into(getattr(msg, spec.name), t, name=f"experience.{spec.name}")
    for key, t in e.info.items():
        encode_tensor_into(msg.info[key], t, name=f"experience.info[{key!r}]")
    if e.response_texts is not None:
        msg.response_texts.extend(e.response_texts)
    return msg


def experience_from_proto(msg: pb.Experience) -> Experience:
    """Decode and validate; TensorCodecError / InvalidArgument name the offending field."""
    tensors: dict[str, torch.Tensor | None] = {}
    for spec in EXPERIENCE_SPECS:
        name = f"experience.{spec.name}"
        t = decode_optional(msg, spec.name, name=name)
        if t is None and not spec.optional:
            raise InvalidArgument(f"{name} is required")
        tensors[spec.name] = t
    # Sorted: map order on the wire is unspecified, a stable order makes results reproducible.
    info = {
        key: decode_tensor(msg.info[key], name=f"experience.info[{key!r}]")
        for key in sorted(msg.info)
    }
    texts = tuple(msg.response_texts) or None  # repeated strings: "none sent" reads as empty
    return Experience(**tensors, info=info, response_texts=texts)
