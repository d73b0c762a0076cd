"""The safetensors byte stream: the client's chunker and the server's parser, cross-checked with
the real safetensors library in both directions."""

from __future__ import annotations

import hashlib
import json
import struct
import zlib
from collections.abc import Sequence

import pytest
import safetensors.torch
import torch
from helpers_weights import update_weights_requests
from rollserve.client.protocol.errors import InvalidArgument
from rollserve.client.weights.update_file import (
    MAX_CHUNK_BYTES,
    MIN_CHUNK_BYTES,
    iter_safetensors_bytes,
    prepare_update,
    safetensors_header,
    update_weights_messages,
)
from rollserve.server.weights.header import StreamEntry, parse_header
from rollserve.server.weights.stream import SafetensorsStager
from rollserve.v1 import rollout_pb2 as pb


def tricky_state_dict(rows: int = 700) -> dict[str, torch.Tensor]:
    """Views sharing storage (tied, transposed, sliced), every width, 0-dim and empty tensors."""
    torch.manual_seed(0)
    base = torch.randn(rows, 300)  # 700 rows: 840,000 bytes, spanning several 256 KiB chunks
    return {
        "tied.a": base,
        "tied.b": base,
        "transposed": base.T,
        "sliced_rows": base[5:9],
        "strided_cols": base[:, ::7],
        "half": torch.randn(33).half(),
        "bf16": torch.randn(5, 7, dtype=torch.bfloat16),
        "f64": torch.randn(3, dtype=torch.float64),
        "steps": torch.tensor(7, dtype=torch.int64),
        "i8": torch.arange(-5, 6, dtype=torch.int8),
        "i16": torch.arange(9, dtype=torch.int16),
        "i32": torch.arange(11, dtype=torch.int32).reshape(1, 11),
        "u8": torch.arange(13, dtype=torch.uint8),
        "flags": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4),
        "param": torch.nn.Parameter(torch.randn(6, 2)),
    }


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert got[name].shape == tensor.shape, name
        assert torch.equal(got[name].detach(), tensor.detach()), name


@pytest.mark.parametrize(
    ("chunk_bytes", "rows"),
    [(1, 9), (13, 9), (4096, 700), (MIN_CHUNK_BYTES, 700), (MAX_CHUNK_BYTES, 700)],
)
def test_chunks_are_fixed_size_and_form_a_file_safetensors_loads(
    chunk_bytes: int, rows: int
) -> None:
    state_dict = tricky_state_dict(rows)
    chunks = list(iter_safetensors_bytes(state_dict, chunk_bytes))
    assert all(type(c) is bytes for c in chunks)
    assert all(len(c) == chunk_bytes for c in chunks[:-1])
    assert 0 < len(chunks[-1]) <= chunk_bytes
    assert_same(safetensors.torch.load(b"".join(chunks)), state_dict)


def test_header_layout_is_aligned_and_tiles_the_data() -> None:
    state_dict = tricky_state_dict()
    header, specs = safetensors_header(state_dict)
    (length,) = struct.unpack("<Q", header[:8])
    assert len(header) == 8 + length and len(header) % 8 == 0
    document = json.loads(header[8:])
    assert document.pop("__metadata__") == {"format": "pt"}
    assert sorted(document) == sorted(state_dict)
    cursor = 0
    for spec in specs:  # file order: contiguous, each tensor aligned to its itemsize
        assert spec.begin == cursor and spec.begin % state_dict[spec.name].dtype.itemsize == 0
        assert document[spec.name]["data_offsets"] == [spec.begin, spec.end]
        cursor = spec.end
    assert len(b"".join(iter_safetensors_bytes(state_dict, 4096))) == len(header) + cursor


def test_a_remembered_head_is_the_head_of_exactly_those_names_dtypes_and_shapes() -> None:
    # The client keeps the heads of recent (name, dtype, shape) lists: the second call with the
    # same tensors must give the bytes safetensors reads, and any change of a name, a dtype, a
    # shape or the order must give the head of the new tensors, never the remembered one.
    base = {"a": torch.ones(2, 3), "b": torch.ones(4, dtype=torch.float16), "c": torch.ones(5)}
    variants = [
        base,
        {**base, "a": torch.ones(3, 2)},  # same size, another shape
        {**base, "b": torch.ones(4, dtype=torch.bfloat16)},  # same itemsize, another dtype
        {"c": base["c"], "b": base["b"], "a": base["a"]},  # another order
        {"x": base["a"], "b": base["b"], "c": base["c"]},  # another name
    ]
    heads = set()
    for _ in range(2):
        for state_dict in variants:
            header, specs = safetensors_header(state_dict)
            document = json.loads(header[8:])
            for spec in specs:
                tensor = state_dict[spec.name]
                entry = document[spec.name]
                assert entry["shape"] == list(tensor.shape) == list(spec.shape)
                assert entry["dtype"] == spec.dtype
                assert entry["data_offsets"] == [spec.begin, spec.end]
            data = b"".join(iter_safetensors_bytes(state_dict, 4096))
            assert_same(safetensors.torch.load(data), state_dict)
            heads.add(header)
            # The header's manifest is remembered with the head: the same tensors, in file order.
            manifest = prepare_update(state_dict, version=1).header.manifest
            assert [(m.name, tuple(m.shape)) for m in manifest] == [
                (spec.name, spec.shape) for spec in specs
            ]
    assert len(heads) == len(variants)  # one head per variant, the same one on the second pass


def test_a_module_streams_like_its_state_dict() -> None:
    torch.manual_seed(1)
    module = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.LayerNorm(4))
    module.register_buffer("count", torch.tensor([3], dtype=torch.int64))
    assert b"".join(iter_safetensors_bytes(module, 4096)) == b"".join(
        iter_safetensors_bytes(module.state_dict(), 4096)
    )


def test_requests_carry_header_offsets_and_checksums() -> None:
    state_dict = tricky_state_dict()
    requests = list(
        update_weights_requests(
            state_dict,
            target="critic",
            version=9,
            mode="partial",
            chunk_bytes=MIN_CHUNK_BYTES,
            crc32=True,
            sha256=True,
        )
    )
    header = requests[0].header
    chunks = [r.chunk for r in requests[1:]]
    blob = b"".join(c.data for c in chunks)
    assert requests[0].WhichOneof("payload") == "header"
    assert all(r.WhichOneof("payload") == "chunk" for r in requests[1:])
    assert (header.target, header.version, header.mode) == (
        pb.MODEL_ROLE_CRITIC,
        9,
        pb.UPDATE_MODE_PARTIAL,
    )
    assert header.total_bytes == len(blob) and len(chunks) == -(-len(blob) // MIN_CHUNK_BYTES)
    assert header.sha256 == hashlib.sha256(blob).hexdigest()
    assert [c.offset for c in chunks] == [i * MIN_CHUNK_BYTES for i in range(len(chunks))]
    assert all(c.HasField("crc32") and c.crc32 == zlib.crc32(c.data) for c in chunks)
    manifest = {s.name: (s.dtype, tuple(s.shape)) for s in header.manifest}
    assert manifest["bf16"] == (pb.DTYPE_BFLOAT16, (5, 7))
    assert manifest["steps"] == (pb.DTYPE_INT64, ())
    assert len(manifest) == len(state_dict)
    assert_same(safetensors.torch.load(blob), state_dict)


def test_optional_header_fields_can_be_left_out() -> None:
    requests = list(  # checksums are asked for, never on by default
        update_weights_requests(
            {"w": torch.ones(3)},
            target=pb.MODEL_ROLE_ACTOR,
            version=1,
            mode=pb.UPDATE_MODE_FULL,
            manifest=False,
        )
    )
    assert not requests[0].header.manifest and not requests[0].header.sha256
    assert not requests[0].header.HasField("lora")
    assert not any(r.chunk.HasField("crc32") for r in requests[1:])


@pytest.mark.parametrize(
    "kwargs",
    [
        {"chunk_bytes": MIN_CHUNK_BYTES - 1},
        {"chunk_bytes": MAX_CHUNK_BYTES + 1},
        {"mode": "lora"},  # lora mode without adapter parameters
        {"lora": pb.LoraAdapter(rank=2, alpha=4.0)},  # adapter parameters without lora mode
        {"mode": "sideways"},
        {"target": 42},
        {"version": -1},
    ],
)
def test_bad_arguments_raise_before_the_first_message(kwargs: dict) -> None:
    arguments = {"target": "actor", "version": 1, "mode": "full", **kwargs}
    with pytest.raises(InvalidArgument):
        update_weights_messages({"w": torch.ones(3)}, **arguments)


def test_unsupported_dtypes_and_names_are_refused() -> None:
    with pytest.raises(InvalidArgument, match="complex"):
        safetensors_header({"z": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(InvalidArgument, match="__metadata__"):
        safetensors_header({"__metadata__": torch.zeros(2)})


class Collect:
    """StreamChecks that accept everything and record what they saw."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.checked: dict[str, list[torch.Tensor]] = {}

    def check_header(self, entries: Sequence[StreamEntry]) -> None:
        self.names = [e.name for e in entries]

    def check_elements(self, entry: StreamEntry, values: torch.Tensor) -> None:
        assert values.dim() == 1 and values.numel() > 0 and values.dtype == entry.dtype
        self.checked.setdefault(entry.name, []).append(values.clone())


def parse_blob(blob: bytes, chunk_bytes: int) -> dict[str, torch.Tensor]:
    checks = Collect()
    stager = SafetensorsStager(
        len(blob), checks, max_header_bytes=1 << 20, sha256_hex=hashlib.sha256(blob).hexdigest()
    )
    for offset in range(0, len(blob), chunk_bytes):
        stager.feed(
            offset,
            blob[offset : offset + chunk_bytes],
            zlib.crc32(blob[offset : offset + chunk_bytes]),
        )
    staged = stager.finish()
    assert sorted(checks.names) == sorted(staged.tensors)
    for name, tensor in staged.tensors.items():  # runs in order, every element exactly once
        runs = checks.checked.get(name, [])
        assert torch.equal(torch.cat([tensor.reshape(-1)[:0], *runs]), tensor.reshape(-1)), name
    return dict(staged.tensors)


@pytest.mark.parametrize(("chunk_bytes", "rows"), [(1, 9), (5, 9), (4096, 700), (1 << 20, 700)])
def test_files_written_by_safetensors_parse_in_our_stager(chunk_bytes: int, rows: int) -> None:
    state_dict = {k: v.detach().clone().contiguous() for k, v in tricky_state_dict(rows).items()}
    state_dict.pop("tied.b")  # safetensors.torch.save refuses shared storage
    blob = safetensors.torch.save(state_dict, metadata={"note": "written by safetensors"})
    assert_same(parse_blob(blob, chunk_bytes), state_dict)


def handmade_file(entries: dict[str, tuple[str, list[int], bytes]], order: list[str]) -> bytes:
    """A safetensors file with tensors in the given data order (so possibly misaligned)."""
    header, data, cursor = {}, b"", 0
    for name in order:
        dtype, shape, raw = entries[name]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [cursor, cursor + len(raw)]}
        data += raw
        cursor += len(raw)
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def test_misaligned_tensors_are_relocated_in_the_arena() -> None:
    bf16 = torch.randn(3, dtype=torch.bfloat16)  # 6 bytes: the next tensor starts at offset 6
    f32 = torch.randn(2, 3)
    f64 = torch.randn(5, dtype=torch.float64)
    raw = lambda t: t.contiguous().view(torch.uint8).numpy().tobytes()  # noqa: E731
    entries = {
        "b": ("BF16", [3], raw(bf16)),
        "f": ("F32", [2, 3], raw(f32)),
        "d": ("F64", [5], raw(f64)),
        "u": ("U8", [1], b"\x07"),
    }
    blob = handmade_file(entries, ["u", "b", "f", "d"])
    for chunk_bytes in (1, 3, 64, len(blob)):
        got = parse_blob(blob, chunk_bytes)
        assert (
            torch.equal(got["b"], bf16)
            and torch.equal(got["f"], f32)
            and torch.equal(got["d"], f64)
        )
        assert got["u"].tolist() == [7]
    assert_same(parse_blob(blob, 7), safetensors.torch.load(blob))


def header_bytes(document: object) -> bytes:
    return json.dumps(document).encode()


GOOD = {"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}


@pytest.mark.parametrize(
    ("raw", "data_bytes", "match"),
    [
        (b"not json", 16, "JSON"),
        (b"\xff\xfe", 16, "UTF-8"),
        (header_bytes([1, 2]), 16, "object"),
        (
            header_bytes({"w": {"dtype": "F8_E4M3", "shape": [16], "data_offsets": [0, 16]}}),
            16,
            "unsupported dtype",
        ),
        (
            header_bytes({"w": {"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}}),
            16,
            "non-negative",
        ),
        (
            header_bytes({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 12]}}),
            12,
            "expected 16",
        ),
        (
            header_bytes({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [16, 0]}}),
            16,
            "data_offsets",
        ),
        (
            header_bytes({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16], "x": 1}}),
            16,
            "exactly",
        ),
        (
            header_bytes({**GOOD, "v": {"dtype": "F32", "shape": [1], "data_offsets": [20, 24]}}),
            24,
            "gap",
        ),
        (
            header_bytes({**GOOD, "v": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}),
            16,
            "overlap",
        ),
        (header_bytes(GOOD), 20, "cover 16 bytes"),
        (header_bytes({**GOOD, "__metadata__": {"k": 1}}), 16, "__metadata__"),
        (
            b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, '
            b'"w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}',
            8,
            "duplicate",
        ),
        (
            header_bytes({"": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}),
            16,
            "empty tensor name",
        ),
    ],
)
def test_bad_headers_are_refused(raw: bytes, data_bytes: int, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        parse_header(raw, data_bytes)


def test_a_good_header_parses_in_data_order() -> None:
    document = {**GOOD, "first": {"dtype": "I64", "shape": [], "data_offsets": [0, 8]}}
    document["w"] = {"dtype": "F32", "shape": [2, 2], "data_offsets": [8, 24]}
    entries = parse_header(header_bytes({"__metadata__": {"a": "b"}, **document}), 24)
    assert [(e.name, e.dtype, e.shape) for e in entries] == [
        ("first", torch.int64, ()),
        ("w", torch.float32, (2, 2)),
    ]


@pytest.mark.parametrize("sha256", ["none", "right", "wrong"])
def test_a_lane_that_took_exactly_the_head_receives_the_data_in_place(sha256: str) -> None:
    """A broadcast posts receives for the data section right after the head arrived: from then
    on `destination` hands out arena memory (no bounce buffer, no copy), and `commit` checks
    the values and hashes what landed."""
    state_dict = {"a": torch.randn(64), "b": torch.randn(8, 4)}
    blob = safetensors.torch.save(state_dict)
    checks = Collect()
    digest = {"none": None, "right": hashlib.sha256(blob).hexdigest(), "wrong": "0" * 64}[sha256]
    stager = SafetensorsStager(len(blob), checks, max_header_bytes=1 << 20, sha256_hex=digest)
    lane = stager.lane(0, len(blob))
    data_start = 8 + int.from_bytes(blob[:8], "little")
    assert lane.destination(data_start, 16) is None  # nothing known before the head
    lane.feed(0, blob[:data_start])
    data_bytes = len(blob) - data_start
    first = lane.destination(data_start, data_bytes // 2)
    second = lane.destination(data_start + data_bytes // 2, data_bytes - data_bytes // 2)
    assert first is not None and second is not None  # both posted before the first commit
    for target, begin in ((first, data_start), (second, data_start + data_bytes // 2)):
        target.copy_(torch.frombuffer(bytearray(blob[begin : begin + target.numel()]),
                                      dtype=torch.uint8))  # fmt: skip
        lane.commit(target.numel())
    assert sorted(checks.names) == ["a", "b"]
    if sha256 == "wrong":
        with pytest.raises(InvalidArgument, match="sha256"):
            stager.finish()
        return
    assert_same(dict(stager.finish().tensors), state_dict)
