"""The version-independent fields of a WeightsHeader, validated once into a frozen options object.

Version checks (is `version` above the target's current one?) belong to the servicer, which knows
the serving versions; everything here depends on the header alone.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ...client.protocol.errors import InvalidArgument
from ...v1 import rollout_pb2 as pb
from .header import PREFIX_BYTES

__all__ = ["LoraParams", "UpdateOptions", "update_options"]

_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
# The smallest safetensors file: the 8-byte length and "{}".
_MIN_FILE_BYTES = PREFIX_BYTES + 2
# The highest version an update may set. The header's version is a uint64, but every Experience
# stamps its rows' version as int64 (Experience.policy_version): an actor at 2**63 or above made
# every later MakeExperience fail with INTERNAL, and versions never go back down.
MAX_VERSION = 2**63 - 1


@dataclass(frozen=True)
class LoraParams:
    """The adapter's rank r and alpha; the delta is (alpha / r) * B @ A."""

    rank: int
    alpha: float
    fan_in_fan_out: bool
    # Refuse a merge whose result is NaN or infinite (header.allow_non_finite off): finite
    # factors can still overflow in alpha / r * B @ A or in the cast to the weight's dtype.
    check_finite: bool = True

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


@dataclass(frozen=True)
class UpdateOptions:
    """What the header asks for; mode UNSPECIFIED is already resolved to FULL."""

    target: int  # pb.ModelRole
    version: int
    mode: int  # pb.UpdateMode: FULL, PARTIAL or LORA
    total_bytes: int
    manifest: tuple[pb.TensorSpec, ...]
    sha256: str | None  # lowercase hex, or None when the client sent none
    lora: LoraParams | None  # set exactly in LORA mode
    allow_non_finite: bool
    # The manifest as the bytes of a header that holds only it: what a repeated update's head
    # is matched by (verify.StreamChecks.head_key), ~10x cheaper than serializing each spec.
    manifest_key: bytes = b""


def update_options(header: pb.WeightsHeader) -> UpdateOptions:
    """Validate the header fields that do not depend on the serving versions."""
    mode = header.mode or pb.UPDATE_MODE_FULL
    if mode not in (pb.UPDATE_MODE_FULL, pb.UPDATE_MODE_PARTIAL, pb.UPDATE_MODE_LORA):
        raise InvalidArgument(f"header.mode: unknown value {header.mode}")
    if header.target not in pb.ModelRole.values():
        raise InvalidArgument(f"header.target: unknown value {header.target}")
    if header.version > MAX_VERSION:
        raise InvalidArgument(
            f"header.version: at most 2**63 - 1 (Experience.policy_version is int64), got "
            f"{header.version}"
        )
    if header.total_bytes < _MIN_FILE_BYTES:
        raise InvalidArgument(
            f"header.total_bytes must be at least {_MIN_FILE_BYTES}, got {header.total_bytes}"
        )
    if header.sha256 and not _SHA256_HEX.fullmatch(header.sha256):
        raise InvalidArgument("header.sha256 must be 64 lowercase hex digits")
    return UpdateOptions(
        target=header.target,
        version=header.version,
        mode=mode,
        total_bytes=header.total_bytes,
        manifest=tuple(header.manifest),
        manifest_key=_manifest_key(header),
        sha256=header.sha256 or None,
        lora=_lora_params(header, mode),
        allow_non_finite=header.allow_non_finite,
    )


def _manifest_key(header: pb.WeightsHeader) -> bytes:
    manifest_only = pb.WeightsHeader()
    manifest_only.CopyFrom(header)  # in C; merging the repeated field costs ~10x more
    for field, _ in manifest_only.ListFields():
        if field.name != "manifest":
            manifest_only.ClearField(field.name)
    return manifest_only.SerializeToString(deterministic=True)


def _lora_params(header: pb.WeightsHeader, mode: int) -> LoraParams | None:
    if mode != pb.UPDATE_MODE_LORA:
        if header.HasField("lora"):
            raise InvalidArgument("header.lora is only allowed with UPDATE_MODE_LORA")
        return None
    if not header.HasField("lora"):
        raise InvalidArgument("header.lora is required with UPDATE_MODE_LORA")
    lora = header.lora
    if lora.rank <= 0:
        raise InvalidArgument(f"header.lora.rank must be positive, got {lora.rank}")
    if not math.isfinite(lora.alpha):
        raise InvalidArgument(f"header.lora.alpha must be finite, got {lora.alpha}")
    return LoraParams(
        rank=lora.rank,
        alpha=lora.alpha,
        fan_in_fan_out=lora.fan_in_fan_out,
        check_finite=not header.allow_non_finite,
    )
