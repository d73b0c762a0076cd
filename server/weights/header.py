"""The safetensors header: parse the JSON once, validate every entry, compare with a manifest.

Layout of a safetensors file: 8-byte little-endian N, N bytes of UTF-8 JSON
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__"?: {str: str}}, then the
data section. Offsets are relative to the data section and must tile it exactly: no gaps, no
overlaps, each range exactly prod(shape) * itemsize bytes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ...client.protocol.dtypes import PROTO_DTYPES, SAFETENSORS_DTYPES
from ...client.protocol.errors import InvalidArgument
from ...v1 import rollout_pb2 as pb

__all__ = [
    "DEFAULT_MAX_HEADER_BYTES",
    "PREFIX_BYTES",
    "StreamEntry",
    "check_manifest",
    "preview",
    "parse_header",
]

PREFIX_BYTES = 8
# A 70B model's header is ~100 KB; this bound only stops a client from making us buffer garbage.
DEFAULT_MAX_HEADER_BYTES = 64 * 1024 * 1024
_ENTRY_KEYS = {"dtype", "shape", "data_offsets"}


@dataclass(frozen=True)
class StreamEntry:
    """One tensor of the incoming file; begin/end are byte offsets into the data section."""

    name: str
    dtype_name: str  # safetensors dtype string, e.g. "BF16"
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def dtype(self) -> torch.dtype:
        return SAFETENSORS_DTYPES[self.dtype_name]

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def preview(names: Sequence[str], limit: int = 5) -> str:
    """The first few names of a list for an error message, with a count of the rest."""
    names = sorted(names)
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown}, ... ({len(names) - limit} more)"


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    # json.loads silently keeps the last of two equal keys; a file with two meanings is refused.
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise InvalidArgument(f"safetensors header: duplicate key {key!r}")
        seen.add(key)
    return dict(pairs)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_entry(name: str, info: object) -> StreamEntry:
    if not name:
        raise InvalidArgument("safetensors header: empty tensor name")
    if not isinstance(info, dict) or set(info) != _ENTRY_KEYS:
        raise InvalidArgument(f"safetensors header: {name}: expected exactly {sorted(_ENTRY_KEYS)}")
    dtype_name, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    # A string first: a JSON list or object is unhashable, and the lookup raised TypeError
    # (INTERNAL) instead of refusing the file.
    if not isinstance(dtype_name, str) or dtype_name not in SAFETENSORS_DTYPES:
        raise InvalidArgument(
            f"safetensors header: {name}: unsupported dtype {dtype_name!r} "
            f"(supported: {', '.join(SAFETENSORS_DTYPES)})"
        )
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise InvalidArgument(f"safetensors header: {name}: shape must be non-negative ints")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_int(o) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise InvalidArgument(f"safetensors header: {name}: data_offsets must be [begin, end]")
    entry = StreamEntry(name, dtype_name, tuple(shape), offsets[0], offsets[1])
    expected = math.prod(entry.shape) * entry.dtype.itemsize
    if entry.nbytes != expected:
        raise InvalidArgument(
            f"safetensors header: {name}: {entry.nbytes} bytes for shape {list(shape)} "
            f"{dtype_name} (expected {expected})"
        )
    return entry


def parse_header(raw: bytes, data_bytes: int) -> tuple[StreamEntry, ...]:
    """Validate the JSON header; entries are returned in data order and tile data_bytes exactly."""
    try:
        document = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError too
        raise InvalidArgument(f"safetensors header is not valid UTF-8 JSON: {exc}") from None
    if not isinstance(document, dict):
        raise InvalidArgument("safetensors header must be a JSON object")
    metadata = document.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise InvalidArgument("safetensors header: __metadata__ must map strings to strings")
    entries = sorted(
        (_parse_entry(name, info) for name, info in document.items()),
        key=lambda e: (e.begin, e.end),
    )
    cursor = 0
    for entry in entries:
        if entry.begin != cursor:
            kind = "gap" if entry.begin > cursor else "overlap"
            raise InvalidArgument(
                f"safetensors header: {kind} in the data section at byte {cursor} ({entry.name})"
            )
        cursor = entry.end
    if cursor != data_bytes:
        raise InvalidArgument(
            f"safetensors header: tensors cover {cursor} bytes but the data section has "
            f"{data_bytes} (total_bytes - 8 - header length)"
        )
    return tuple(entries)


def check_manifest(entries: Sequence[StreamEntry], manifest: Sequence[pb.TensorSpec]) -> None:
    """An empty manifest means none was sent; otherwise it must describe the file exactly."""
    if not manifest:
        return
    declared: dict[str, tuple[int, tuple[int, ...]]] = {}
    for spec in manifest:
        if spec.name in declared:
            raise InvalidArgument(f"manifest: duplicate name {spec.name!r}")
        declared[spec.name] = (spec.dtype, tuple(spec.shape))
    actual = {e.name: (PROTO_DTYPES[e.dtype_name], e.shape) for e in entries}
    missing = [n for n in declared if n not in actual]
    extra = [n for n in actual if n not in declared]
    differ = [n for n in declared if n in actual and declared[n] != actual[n]]
    problems = []
    if missing:
        problems.append(f"in the manifest but not the file: {preview(missing)}")
    if extra:
        problems.append(f"in the file but not the manifest: {preview(extra)}")
    if differ:
        problems.append(f"dtype or shape differ: {preview(differ)}")
    if problems:
        raise InvalidArgument(
            "manifest does not match the safetensors header; " + "; ".join(problems)
        )
