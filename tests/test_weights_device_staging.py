"""Pipelined staging into a device arena (server/weights/pipeline.py): host bytes through a small
ring of slots, copies into the arena, per-tensor value checks read once at the end.

On the CPU the same code runs with a "device" arena on the CPU (no stream, no pinning), through a
ring of small slots so every chunk crosses slot, tensor and lane boundaries: bytes land exactly,
bad values are refused with the host path's messages and leave the old weights bit for bit, the
parameters keep their storages, and a real gRPC server staged this way takes every transport.
The tests marked `gpu` run the same on a CUDA bfloat16 model (skipped without CUDA).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import struct
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch
from helpers_weights import (
    in_place_updates,
    perturbed,
    state_hash,
    tiny_llama,
    update_in_place,
    update_weights_requests,
)
from rollserve.client import RolloutClient
from rollserve.client.protocol.errors import InvalidArgument, ResourceExhausted
from rollserve.client.weights.distributed import WeightsGroup
from rollserve.server.config import ServerConfig
from rollserve.server.generation import GenerationSettings, adopt_settings, engine_for
from rollserve.server.generation.registry import staging_reserve_bytes
from rollserve.server.models import ModelSet, load_models
from rollserve.server.models.default_model import TinyModelSpec, save_tiny_causal_lm
from rollserve.server.serving.app import RolloutServer
from rollserve.server.weights import UpdateStager, staging_arena
from rollserve.server.weights.arena import (
    DEVICE_MARGIN_BYTES,
    StagingArena,
    device_has_room,
    set_staging_arena,
)
from rollserve.server.weights.header import StreamEntry
from rollserve.server.weights.pipeline import RING_SLOTS, SLOT_BYTES, SlotRing
from rollserve.server.weights.shared_memory import mapping_page_locked
from rollserve.server.weights.stream import SafetensorsStager
from rollserve.server.weights.verify import CheckGroup, DeferredValues, ValueRule, check_values
from rollserve.v1 import rollout_pb2 as pb
from test_weights_staging import FAILURES, cut_requests, make_requests, recut
from transformers import LlamaForCausalLM

KIB = 1024
WAIT_S = 30.0
Q = "model.layers.0.self_attn.q_proj.weight"


def cpu_arena(slot_bytes: int = 4093, slots: int = 3, **options: object) -> StagingArena:
    """A pipelined arena on the CPU whose ring has a few small, odd-sized slots."""
    ring = SlotRing(pin_memory=False, slots=slots, slot_bytes=slot_bytes)
    return StagingArena(device="cpu", ring=ring, **options)  # type: ignore[arg-type]


def pipelined(model: torch.nn.Module, **options: object) -> StagingArena:
    arena = cpu_arena(**options)
    set_staging_arena(model, arena)
    return arena


def every(chunk_bytes: int, requests: list[pb.UpdateWeightsRequest]) -> list:
    """The same update in chunks of chunk_bytes."""
    total = requests[0].header.total_bytes
    return recut(requests, list(range(chunk_bytes, total, chunk_bytes)))


def pointers(model: torch.nn.Module) -> dict[str, int]:
    return {name: t.data_ptr() for name, t in model.state_dict(keep_vars=True).items()}


def assert_bits_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name].cpu().view(torch.uint8), tensor.cpu().view(torch.uint8)), name


# ---- the stager: odd chunks, many lanes, out of order ---------------------------------------


class Record:
    """StreamChecks that record every tensor's bytes when its check runs (one check group per
    tensor with elements, of every dtype: the pipeline launches a group once all its bytes are
    in)."""

    def __init__(self) -> None:
        self.checked: dict[str, torch.Tensor] = {}
        self.settled = 0
        self._groups: tuple[CheckGroup, ...] = ()
        self._lock = threading.Lock()

    def check_header(self, entries: Sequence[StreamEntry]) -> None:
        self._groups = tuple(
            CheckGroup(ValueRule(False), e.dtype, (e.name,), (e.nbytes,), e.begin, e.end)
            for e in entries
            if e.nbytes
        )

    def check_elements(self, entry: StreamEntry, values: torch.Tensor) -> None:
        raise AssertionError("a device arena checks whole groups, not runs")

    def device_groups(self) -> tuple[CheckGroup, ...]:
        return self._groups

    def launch_check(self, index: int, raw: torch.Tensor) -> None:
        group = self._groups[index]
        assert raw.dim() == 1 and raw.dtype == torch.uint8 and len(raw) == sum(group.sizes)
        with self._lock:
            assert group.names[0] not in self.checked, f"{group.names[0]} checked twice"
            self.checked[group.names[0]] = raw.view(group.dtype).clone()

    def settle(self) -> None:
        self.settled += 1

    def head_key(self) -> None:
        return None  # never reused: every update records its own checks


SAFETENSORS_DTYPES = {torch.uint8: "U8", torch.bfloat16: "BF16", torch.float32: "F32",
                      torch.float64: "F64", torch.float16: "F16", torch.bool: "BOOL",
                      torch.int32: "I32"}  # fmt: skip


def misaligned_file() -> tuple[bytes, dict[str, torch.Tensor]]:
    """Tensors of every width, some misaligned in the file (the arena shifts them), one empty."""
    generator = torch.Generator().manual_seed(4)
    tensors = {
        "u": torch.tensor([7], dtype=torch.uint8),
        "b": torch.randn(3001, generator=generator).to(torch.bfloat16),
        "f": torch.randn(37, 29, generator=generator),
        "empty": torch.zeros(0, 3),
        "d": torch.randn(523, generator=generator, dtype=torch.float64),
        "h": torch.randn(77, generator=generator).half(),
        "flags": torch.tensor([True, False, True]),
        "i": torch.arange(-50, 50, dtype=torch.int32),
    }
    header, data, cursor = {}, b"", 0
    for name, tensor in tensors.items():
        raw = tensor.contiguous().view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        dtype = SAFETENSORS_DTYPES[tensor.dtype]
        header[name] = {"dtype": dtype, "shape": list(tensor.shape),
                        "data_offsets": [cursor, cursor + len(raw)]}  # fmt: skip
        data += raw
        cursor += len(raw)
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data, tensors


@pytest.mark.parametrize("sha256", [False, True])
@pytest.mark.parametrize("lanes", [1, 2, 5])
def test_odd_chunks_on_lanes_out_of_order_land_exactly(lanes: int, sha256: bool) -> None:
    blob, tensors = misaligned_file()
    data_start = 8 + int.from_bytes(blob[:8], "little")
    arena = cpu_arena(slot_bytes=1000, slots=2)
    checks = Record()
    digest = hashlib.sha256(blob).hexdigest() if sha256 else None
    stager = SafetensorsStager(len(blob), checks, max_header_bytes=1 << 20, sha256_hex=digest,
                               arena=arena)  # fmt: skip
    with arena.lease():
        # Lane 0 holds the head and a little data; the rest is cut at odd offsets.
        rng = random.Random(lanes)
        cuts = sorted(rng.sample(range(data_start + 1, len(blob)), lanes - 1))
        bounds = [0, *cuts, len(blob)]
        spans = list(zip(bounds, bounds[1:], strict=False))
        lane_list = [stager.lane(begin, end) for begin, end in spans]

        def feed(lane_index: int) -> None:
            lane = lane_list[lane_index]
            if lane.begin > 0:
                lane.start_in_data(timeout_s=WAIT_S)
            while lane.position < lane.end:
                size = min(rng_sizes[lane_index].randint(1, 2500), lane.end - lane.position)
                lane.feed(lane.position, blob[lane.position : lane.position + size])

        rng_sizes = [random.Random(100 + i) for i in range(lanes)]
        threads = [threading.Thread(target=feed, args=(i,)) for i in reversed(range(lanes))]
        for thread in threads:  # the last lanes start first: they wait for lane 0's head
            thread.start()
        for thread in threads:
            thread.join(WAIT_S)
        staged = stager.finish()
    assert staged.on_device and arena.staged_on_device and checks.settled == 1
    assert_bits_equal(dict(staged.tensors), tensors)
    # Every tensor with elements was checked once, after all its bytes were in.
    assert sorted(checks.checked) == sorted(n for n, t in tensors.items() if t.numel())
    for name, values in checks.checked.items():
        assert torch.equal(values.view(torch.uint8), tensors[name].reshape(-1).view(torch.uint8))
    assert arena.ring.allocated_bytes <= 2 * 1000


def test_tensor_bytes_through_the_seam_land_exactly() -> None:
    """feed_tensor: the next bytes as uint8 tensors, in pieces that straddle head and tensors."""
    blob, tensors = misaligned_file()
    file = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    for arena in (cpu_arena(slot_bytes=333), StagingArena()):
        checks = Record() if arena.device else _Accept()
        digest = hashlib.sha256(blob).hexdigest()
        stager = SafetensorsStager(len(blob), checks, max_header_bytes=1 << 20, sha256_hex=digest,
                                   arena=arena)  # fmt: skip
        with arena.lease():
            offset = 0
            for size in (3, 9, 500, 4001, 7, len(blob)):
                piece = file[offset : offset + size]
                if len(piece):
                    stager.feed_tensor(offset, piece)
                offset += len(piece)
            staged = stager.finish()
        assert staged.on_device == (arena.device is not None)
        assert_bits_equal(dict(staged.tensors), tensors)
    with pytest.raises(InvalidArgument, match="1-D contiguous uint8"):
        SafetensorsStager(8, _Accept(), max_header_bytes=64).feed_tensor(0, torch.zeros(2, 4))


def stage_on_lanes(
    blob: bytes, arena: StagingArena, lanes: int, seed: int, *, sha256: bool = True
) -> tuple[dict[str, torch.Tensor], Record, int]:
    """Stage `blob` through `arena` on `lanes` threads, each fed chunks of 1 to 120 bytes; the
    staged tensors (host copies), the checks, and the chunks fed. The arena starts as garbage,
    so a check that ran before a tensor's last bytes landed would record other values."""
    data_start = 8 + int.from_bytes(blob[:8], "little")
    checks = Record()
    digest = hashlib.sha256(blob).hexdigest() if sha256 else None
    stager = SafetensorsStager(len(blob), checks, max_header_bytes=1 << 20, sha256_hex=digest,
                               arena=arena)  # fmt: skip
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(data_start + 1, len(blob)), lanes - 1))
    bounds = [0, *cuts, len(blob)]
    fed = [0] * lanes
    with arena.lease():
        arena.take(len(blob)).fill_(0xA5)  # the stager takes this same buffer
        lane_list = [
            stager.lane(begin, end) for begin, end in zip(bounds, bounds[1:], strict=False)
        ]

        def feed(index: int) -> None:
            lane, sizes = lane_list[index], random.Random(seed * 100 + index)
            if lane.begin > 0:
                lane.start_in_data(timeout_s=WAIT_S)
            while lane.position < lane.end:
                size = min(sizes.randint(1, 120), lane.end - lane.position)
                lane.feed(lane.position, blob[lane.position : lane.position + size])
                fed[index] += 1

        threads = [threading.Thread(target=feed, args=(i,)) for i in range(lanes)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(WAIT_S)
        staged = stager.finish()
        tensors = {name: t.clone() for name, t in staged.tensors.items()}
    assert staged.on_device and checks.settled == 1
    return tensors, checks, sum(fed)


def lane_data_bytes(blob: bytes, lanes: int, seed: int) -> list[int]:
    """The data-section bytes of each lane `stage_on_lanes` cuts (the same random cuts)."""
    data_start = 8 + int.from_bytes(blob[:8], "little")
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(data_start + 1, len(blob)), lanes - 1))
    bounds = [data_start, *cuts, len(blob)]
    return [end - begin for begin, end in zip(bounds, bounds[1:], strict=False)]


@pytest.mark.parametrize("lanes", [1, 3])
def test_small_chunks_of_a_lane_share_one_slot_copy(lanes: int) -> None:
    """Many small chunks: each lane fills its slot before copying it, so a lane of n data bytes
    costs ceil(n / slot) copies, not one per chunk; the bytes and the checks are unchanged."""
    blob, tensors = misaligned_file()
    arena = cpu_arena(slot_bytes=1000, slots=lanes + 1)  # room for every lane to hold a slot
    staged, checks, chunks = stage_on_lanes(blob, arena, lanes, seed=7)
    assert_bits_equal(staged, tensors)
    assert sorted(checks.checked) == sorted(n for n, t in tensors.items() if t.numel())
    for name, values in checks.checked.items():
        assert torch.equal(values.view(torch.uint8), tensors[name].reshape(-1).view(torch.uint8))
    want = sum(math.ceil(n / 1000) for n in lane_data_bytes(blob, lanes, seed=7))
    assert arena.ring.copies == want
    assert chunks > 5 * want  # the chunks were many more than the copies


def test_coalescing_under_slot_pressure_and_after_a_failed_update() -> None:
    """Five lanes on a ring of two slots: one lane at a time may keep a slot, the others copy
    per chunk, and the bytes still land; a failed update's held slot is reclaimed by the next
    update, which coalesces again."""
    blob, tensors = misaligned_file()
    arena = cpu_arena(slot_bytes=1000, slots=2)
    staged, _, chunks = stage_on_lanes(blob, arena, 5, seed=3, sha256=True)
    assert_bits_equal(staged, tensors)
    assert arena.ring.copies <= chunks and arena.ring.allocated_bytes <= 2 * 1000
    # An update cut after a few chunks leaves a partly filled slot held.
    stager = SafetensorsStager(len(blob), Record(), max_header_bytes=1 << 20, arena=arena)
    with arena.lease():
        stager.feed(0, blob[: len(blob) // 3])
        stager.feed(len(blob) // 3, blob[len(blob) // 3 : len(blob) // 3 + 17])
    copies = arena.ring.copies
    staged, _, _ = stage_on_lanes(blob, arena, 1, seed=5)
    assert_bits_equal(staged, tensors)
    assert arena.ring.copies - copies == math.ceil(lane_data_bytes(blob, 1, seed=5)[0] / 1000)


def test_bytes_a_plane_writes_itself_copy_the_held_slot_first() -> None:
    """Small host chunks, then bytes written straight into the arena (destination / commit),
    then small chunks again on one lane: the slot held before the write is copied at the write,
    so the chunks after it fill a slot of their own (one copy per slot, not one per chunk)."""
    blob, tensors = misaligned_file()
    data_start = 8 + int.from_bytes(blob[:8], "little")
    arena = cpu_arena(slot_bytes=1000, slots=2)
    checks = Record()
    stager = SafetensorsStager(len(blob), checks, max_header_bytes=1 << 20, arena=arena)
    written = (data_start + 700, data_start + 2701)
    with arena.lease():
        arena.take(len(blob)).fill_(0x5A)
        lane = stager.lane(0, len(blob))
        offset = 0
        while offset < len(blob):
            if offset == written[0]:
                run = lane.destination(offset, written[1] - offset)
                assert run is not None  # one segment holds it
                run.copy_(torch.frombuffer(bytearray(blob[offset : written[1]]), dtype=torch.uint8))
                lane.commit(written[1] - offset)
                offset = written[1]
                continue
            end = min(offset + 50, written[0] if offset < written[0] else len(blob))
            lane.feed(offset, blob[offset:end])
            offset = end
        staged = stager.finish()
    assert_bits_equal(dict(staged.tensors), tensors)
    assert sorted(checks.checked) == sorted(n for n, t in tensors.items() if t.numel())
    for name, values in checks.checked.items():
        assert torch.equal(values.view(torch.uint8), tensors[name].reshape(-1).view(torch.uint8))
    assert arena.ring.copies == 1 + math.ceil((len(blob) - written[1]) / 1000)


class _Accept:
    def check_header(self, entries: Sequence[StreamEntry]) -> None:
        return None

    def head_key(self) -> None:
        return None

    def check_elements(self, entry: StreamEntry, values: torch.Tensor) -> None:
        return None


# ---- the update path with a pipelined arena ---------------------------------------------------


@pytest.fixture(scope="module")
def sender() -> LlamaForCausalLM:
    return tiny_llama(1)


@pytest.fixture
def receiver() -> LlamaForCausalLM:
    model = tiny_llama(2)
    pipelined(model)
    return model


@pytest.mark.parametrize("chunk_bytes", [1013, 64 * KIB + 7])
def test_a_full_update_lands_bit_for_bit_in_the_same_storages(
    receiver: LlamaForCausalLM, sender: LlamaForCausalLM, chunk_bytes: int
) -> None:
    before = pointers(receiver)
    arena = staging_arena(receiver)
    first = make_requests(sender, sha256=True)
    update_in_place(receiver, every(chunk_bytes, first))
    assert arena.staged_on_device
    assert_bits_equal(receiver.state_dict(), sender.state_dict())
    assert pointers(receiver) == before  # copied into the storages, never rebound
    # The arena is kept: a second update allocates nothing and lands as well.
    allocations = arena.allocations
    moved = perturbed(sender, seed=3)
    update_in_place(receiver, make_requests(moved, version=6))
    assert arena.allocations == allocations and pointers(receiver) == before
    assert_bits_equal(receiver.state_dict(), moved)
    assert arena.ring.allocated_bytes <= 3 * 4093


def test_a_cast_a_partial_update_and_a_lora_adapter_match_the_host_path(
    sender: LlamaForCausalLM,
) -> None:
    """Each update, staged on the "device" and in host memory, gives the same bits."""
    models = [tiny_llama(2).to(torch.bfloat16) for _ in range(2)]
    pipelined(models[0])
    a = torch.randn(4, 64, generator=torch.Generator().manual_seed(8))
    b = torch.randn(64, 4, generator=torch.Generator().manual_seed(9))
    lora = {"base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight": a,
            "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight": b}  # fmt: skip
    updates = [
        make_requests(sender, version=1),  # float32 into bfloat16: the range rule and a cast
        make_requests({Q: sender.state_dict()[Q] * 3}, version=2, mode="partial"),
        make_requests(lora, version=3, mode="lora", lora=pb.LoraAdapter(rank=4, alpha=8.0)),
    ]
    digests = []
    for model in models:
        updates_of_model = in_place_updates(model)  # one updater: the versions rise
        for requests in updates:
            updates_of_model.update(iter(requests))
        digests.append(state_hash(model))
    assert staging_arena(models[0]).staged_on_device
    assert not staging_arena(models[1]).staged_on_device
    assert digests[0] == digests[1] != state_hash(tiny_llama(2).to(torch.bfloat16))


@pytest.mark.parametrize("case", sorted(FAILURES))
def test_every_failure_leaves_the_model_bit_for_bit(
    case: str, receiver: LlamaForCausalLM, sender: LlamaForCausalLM
) -> None:
    make_state, edit, match = FAILURES[case]
    if case in ("shape_mismatch", "int_for_float"):  # shapes of the other (larger) tiny Llama
        state = dict(sender.state_dict())
        rows, cols = state[Q].shape
        shape_or_dtype = (rows, cols - 1) if case == "shape_mismatch" else (rows, cols)
        dtype = torch.int32 if case == "int_for_float" else torch.float32
        state[Q] = torch.zeros(shape_or_dtype, dtype=dtype)
        match = "shape" if case == "shape_mismatch" else "integer/bool"
    else:
        state = make_state(sender) if make_state else sender
    requests = recut(make_requests(state, sha256=True), [1000, 30_000, 60_000, 90_000])
    if edit is not None:
        requests = edit(requests)
    before, where = state_hash(receiver), pointers(receiver)
    with pytest.raises(InvalidArgument, match=match):
        update_in_place(receiver, requests, max_header_bytes=1 << 20)
    assert state_hash(receiver) == before and pointers(receiver) == where


@pytest.mark.parametrize(
    ("value", "model_dtype", "wire_dtype", "match"),
    [
        (math.nan, torch.float32, torch.float32, "NaN or infinite"),
        (-math.inf, torch.bfloat16, torch.bfloat16, "NaN or infinite"),
        (70_000.0, torch.float16, torch.float32, "value 70000 is beyond"),
        (-3.4e38, torch.bfloat16, torch.float32, "is beyond the model dtype"),
    ],
)
def test_bad_values_are_named_like_the_host_path(
    value: float, model_dtype: torch.dtype, wire_dtype: torch.dtype, match: str
) -> None:
    model = tiny_llama(2).to(model_dtype)
    pipelined(model, slot_bytes=777)
    weights = {k: v.to(wire_dtype) for k, v in tiny_llama(1).state_dict().items()}
    weights[Q][7, 3] = value
    before = state_hash(model)
    requests = make_requests(weights)
    with pytest.raises(InvalidArgument, match=f"^{Q}: .*{match}"):
        update_in_place(model, requests)
    assert state_hash(model) == before
    # The same file through a host arena: the same message.
    host = tiny_llama(2).to(model_dtype)
    with pytest.raises(InvalidArgument) as on_host:
        update_in_place(host, requests)
    with pytest.raises(InvalidArgument) as on_device:
        update_in_place(model, requests)
    assert str(on_device.value) == str(on_host.value)


def test_a_bool_with_a_byte_other_than_0_or_1_is_refused() -> None:
    class Flags(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("mask", torch.tensor([True, False, True]))

    model = Flags()
    pipelined(model)
    requests = make_requests({"mask": torch.tensor([True, True, True])}, crc32=False)
    blob = b"".join(r.chunk.data for r in requests[1:])[:-1] + b"\x02"
    with pytest.raises(InvalidArgument, match="0 and 1"):
        update_in_place(model, cut_requests(requests[0].header, blob, [len(blob) - 2]))
    assert model.mask.tolist() == [True, False, True]


def test_a_cut_stream_leaves_the_model_and_the_next_update_lands(
    receiver: LlamaForCausalLM, sender: LlamaForCausalLM
) -> None:
    class Cut(Exception):
        pass

    def cut_midway() -> Iterator[pb.UpdateWeightsRequest]:
        requests = every(5000, make_requests(sender))
        yield from requests[: len(requests) // 2]
        raise Cut

    before = state_hash(receiver)
    with pytest.raises(Cut):
        update_in_place(receiver, cut_midway())
    assert state_hash(receiver) == before
    update_in_place(receiver, make_requests(sender))
    assert_bits_equal(receiver.state_dict(), sender.state_dict())


def test_non_finite_values_apply_when_allowed(
    receiver: LlamaForCausalLM, sender: LlamaForCausalLM
) -> None:
    weights = dict(sender.state_dict())
    weights[Q] = weights[Q].clone()
    weights[Q][1, 1] = math.nan
    update_in_place(receiver, make_requests(weights, allow_non_finite=True))
    assert_bits_equal(receiver.state_dict(), weights)


def test_an_update_over_the_device_limit_stages_in_host_memory(sender: LlamaForCausalLM) -> None:
    model = tiny_llama(2)
    arena = pipelined(model, device_limit_bytes=1024)
    before = pointers(model)
    update_in_place(model, make_requests(sender))
    assert not arena.staged_on_device and arena.allocations == 1
    assert_bits_equal(model.state_dict(), sender.state_dict())
    assert pointers(model) != before  # the host path adopts the arena on the CPU, as ever


def test_a_device_buffer_that_cannot_be_had_falls_back_to_the_host_for_good() -> None:
    arena = cpu_arena()
    with pytest.raises(ResourceExhausted, match="cpu could not hold it either"):
        arena.take(1 << 50)  # neither the "device" nor the host has a petabyte
    arena.take(4096)
    assert not arena.staged_on_device  # a failed device allocation is final for this arena
    arena.release()
    assert arena.capacity_bytes == 0 and arena.ring.allocated_bytes == 0


MIB = 1 << 20
GIB = 1 << 30


@pytest.mark.parametrize(
    ("free", "cached", "held", "nbytes", "fits"),
    [
        (1000 * MIB, 0, 0, 744 * MIB, True),  # exactly the margin left over
        (1000 * MIB, 0, 0, 745 * MIB, False),  # a byte into the margin
        (500 * MIB, 500 * MIB, 0, 744 * MIB, True),  # blocks torch caches unused count
        (0, 0, 1000 * MIB, 744 * MIB, True),  # the old buffer is freed before the new one
        (300 * MIB, 300 * MIB, 400 * MIB, 745 * MIB, False),
        # An H100 whose KV promises summed past the device refused this one (the old rule):
        (81_482_874_880, 0, 0, 1_840_640, True),
        # A server at --gpu-memory-utilization 0.95 on 80 GiB whose KV cache grew to its
        # budget: what is free is the 5 % outside the share plus the staging copy the budget
        # left (the old rule wanted 10 % free beyond that).
        (4 * GIB + 830 * MIB, 0, 0, 830 * MIB, True),
        # The same with nothing left outside the share: no room for the margin.
        (830 * MIB, 0, 0, 830 * MIB, False),
    ],
)
def test_a_device_buffer_is_had_when_it_fits_in_what_is_free_now_less_a_margin(
    free: int, cached: int, held: int, nbytes: int, fits: bool
) -> None:
    got = device_has_room(
        free=free, cached=cached, held=held, nbytes=nbytes, margin=DEVICE_MARGIN_BYTES
    )
    assert got is fits
    assert DEVICE_MARGIN_BYTES == 256 * MIB  # the figures above are written for it


def state_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def test_a_servers_kv_budget_leaves_one_staging_copy_of_each_model_it_hosts() -> None:
    actor, critic, elsewhere, other_device = (tiny_llama(seed) for seed in (1, 2, 3, 4))
    critic.to(torch.bfloat16)  # in its own dtype: a staging copy is the state dict's bytes
    other_device.to("meta")
    server, other_server = GenerationSettings(), GenerationSettings()
    assert server == other_server  # equal settings, yet two servers: grouped by identity
    for model in (actor, critic, other_device):
        adopt_settings(model, server)
    adopt_settings(elsewhere, other_server)
    assert state_bytes(critic) * 2 == state_bytes(actor)
    assert staging_reserve_bytes(actor) == state_bytes(actor) + state_bytes(critic)
    assert staging_reserve_bytes(critic) == staging_reserve_bytes(actor)
    assert staging_reserve_bytes(elsewhere) == state_bytes(elsewhere)
    assert staging_reserve_bytes(tiny_llama(5)) == state_bytes(actor)  # hosted by no server


@pytest.mark.filterwarnings("ignore:overflow encountered")  # check_values' sum of squares
def test_the_value_checks_agree_with_check_values() -> None:
    """DeferredValues refuses exactly what check_values refuses."""
    cases = []
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        big = torch.finfo(dtype).max
        for values in ([1.0, -2.0], [big, -big], [math.nan], [math.inf, 0.0], [-math.inf]):
            for max_abs in (None, 1.5):
                cases.append((torch.tensor(values, dtype=dtype), ValueRule(True, max_abs)))
    cases.append((torch.tensor([0, 1, 2], dtype=torch.uint8).view(torch.bool), ValueRule(False)))
    cases.append((torch.tensor([True, False]), ValueRule(False)))
    for values, rule in cases:
        raw = values.view(torch.uint8)
        group = CheckGroup(rule, values.dtype, ("t",), (len(raw),), 0, len(raw))
        deferred = DeferredValues((group,))
        deferred.launch(0, raw)
        try:
            check_values("t", values, rule)
            expected = None
        except InvalidArgument as error:
            expected = str(error)
        try:
            deferred.settle()
            got = None
        except InvalidArgument as error:
            got = str(error)
        assert got == expected, (values, rule)


# ---- a real gRPC server whose actor stages through a pipelined arena ------------------------


SPEC = TinyModelSpec(hidden_size=128, intermediate_size=384)
TRANSPORTS = ["grpc", "grpc-parallel", "shm", "dist"]


@pytest.fixture(scope="module")
def actor_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_causal_lm(tmp_path_factory.mktemp("device-staging-actor"), SPEC)


@pytest.fixture(scope="module")
def models(actor_dir: Path) -> ModelSet:
    loaded = load_models(ServerConfig(device="cpu", actor=str(actor_dir)))
    pipelined(loaded.actor.module, slot_bytes=64 * KIB + 3, slots=4)
    return loaded


def send(client: RolloutClient, transport: str, weights: dict, **options: object) -> object:
    """client.update_weights over one transport (grpc-parallel: 3 streams of 256 KiB chunks)."""
    if transport == "dist":  # gloo: host buckets, whatever the server's device
        with WeightsGroup([client], timeout_s=WAIT_S, bucket_bytes=96 * KIB,
                          backend="gloo") as group:  # fmt: skip
            return client.update_weights(weights, transport="dist", group=group, **options)
    if transport == "grpc-parallel":
        options.update(streams=3, chunk_bytes=256 * KIB)
        transport = "grpc"
    elif transport == "grpc":
        options.update(streams=1)
    return client.update_weights(weights, transport=transport, **options)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_grpc_server_staged_this_way_takes_every_transport(
    models: ModelSet, transport: str
) -> None:
    actor = models.actor.module
    arena = staging_arena(actor)
    config = ServerConfig(host="127.0.0.1", port=0, device="cpu", metrics_port=0)
    with RolloutServer(config, models=models) as server:
        with RolloutClient(server.address, timeout_s=WAIT_S) as client:
            where = pointers(actor)
            weights = perturbed(actor, seed=21)
            result = send(client, transport, weights, version=1, sha256=True)
            assert result.version == 1  # type: ignore[attr-defined]
            assert arena.staged_on_device
            assert_bits_equal(actor.state_dict(), weights)
            assert pointers(actor) == where
            # A bad value anywhere: refused, the served weights stay bit for bit.
            bad = perturbed(actor, seed=22)
            bad[Q][0, 0] = math.nan
            before = state_hash(actor)
            with pytest.raises(InvalidArgument, match="NaN or infinite"):
                send(client, transport, bad, version=2)
            assert state_hash(actor) == before and client.health().policy_version == 1
    assert arena.ring.allocated_bytes <= 4 * (64 * KIB + 3)


# ---- on a CUDA device (marked gpu: skipped without CUDA) ------------------------------------


@pytest.fixture(scope="module")
def gpu_actor_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_causal_lm(tmp_path_factory.mktemp("gpu-staging-actor"), SPEC)


def _host_pinned_bytes() -> int | None:
    stats = torch.cuda.host_memory_stats()
    value = stats.get("allocated_bytes.all.current", stats.get("allocated_bytes.current"))
    return None if value is None else int(value)


@pytest.mark.gpu
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_cuda_bf16_server_is_updated_on_the_device(
    gpu_actor_dir: Path, transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One transport with the generation engine (its CUDA graphs, its KV budget weighed by the
    # arena), uncompiled to keep the test short; the others on the Hugging Face path.
    monkeypatch.setenv("ROLLSERVE_ENGINE_COMPILE", "0")
    path = "auto" if transport == "grpc" else "hf"
    config = ServerConfig(host="127.0.0.1", port=0, device="cuda", dtype="bfloat16",
                          metrics_port=0, actor=str(gpu_actor_dir),
                          generation_path=path)  # fmt: skip
    models = load_models(config)
    actor = models.actor.module
    arena = staging_arena(actor)
    pinned_before = _host_pinned_bytes()
    with RolloutServer(config, models=models) as server:
        with RolloutClient(server.address, timeout_s=WAIT_S) as client:
            # After the warm-up: the engine fuses q/k/v and gate/up there (fused.py), so the
            # parameters become views of new tensors, which its CUDA graphs then read.
            client.wait_until_ready(WAIT_S)
            where = pointers(actor)
            for version, device in ((1, "cpu"), (2, "cuda")):
                source = {k: v.float().cpu() for k, v in actor.state_dict().items()}
                weights = {k: (v + 0.01 * version).to(device) for k, v in perturbed_dict(source)}
                send(client, transport, weights, version=version, sha256=version == 2)
                assert arena.staged_on_device and arena.device.type == "cuda"
                if transport == "shm":  # its mapping is copied by DMA, not through the ring
                    assert mapping_page_locked()
                want = {k: v.cpu().to(torch.bfloat16) for k, v in weights.items()}
                assert_bits_equal(actor.state_dict(), want)
                assert pointers(actor) == where  # the engine's CUDA graphs stay valid
            bad = {k: v.clone() for k, v in weights.items()}
            bad[Q][2, 2] = math.inf
            before = state_hash(actor)
            with pytest.raises(InvalidArgument, match=f"{Q}: NaN or infinite"):
                send(client, transport, bad, version=3)
            assert state_hash(actor) == before and pointers(actor) == where
            assert client.health().policy_version == 2
    assert arena.ring.allocated_bytes <= RING_SLOTS * SLOT_BYTES
    pinned_after = _host_pinned_bytes()
    if pinned_before is not None and pinned_after is not None:
        # Host pinned memory: the ring only (plus the caching allocator's rounding).
        assert pinned_after - pinned_before <= 2 * RING_SLOTS * SLOT_BYTES


def perturbed_dict(source: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(31)
    for name, tensor in source.items():
        yield name, tensor + 0.05 * torch.randn(tensor.shape, generator=generator)


@pytest.mark.gpu
def test_device_bytes_are_copied_device_to_device_and_lora_applies(gpu_actor_dir: Path) -> None:
    model = LlamaForCausalLM.from_pretrained(gpu_actor_dir).to("cuda", torch.bfloat16)
    where = pointers(model)
    source = {k: v.float() for k, v in tiny_weights_like(model).items()}
    requests = list(update_weights_requests(source, target="actor", version=1, mode="full"))
    blob = b"".join(r.chunk.data for r in requests[1:])
    on_device = torch.frombuffer(bytearray(blob), dtype=torch.uint8).cuda()
    arena = staging_arena(model)
    with arena.lease():
        stager = UpdateStager(requests[0].header, model, None, arena=arena)
        for offset in range(0, len(blob), 1 << 20):
            stager.feed_tensor(offset, on_device[offset : offset + (1 << 20)])
        staged = stager.finish()
        assert staged.on_device
        staged.apply(model)
    assert_bits_equal(model.state_dict(), {k: v.to(torch.bfloat16) for k, v in source.items()})
    assert pointers(model) == where
    # LoRA from a device arena merges like the host path (the factors go to the host).
    name = "model.layers.0.self_attn.q_proj"
    base = model.state_dict()[f"{name}.weight"].float().cpu()
    generator = torch.Generator().manual_seed(5)
    a = torch.randn(2, base.shape[1], generator=generator)
    b = torch.randn(base.shape[0], 2, generator=generator)
    adapter = {f"base_model.model.{name}.lora_A.weight": a,
               f"base_model.model.{name}.lora_B.weight": b}  # fmt: skip
    lora = pb.LoraAdapter(rank=2, alpha=2.0)
    requests = make_requests(adapter, version=2, mode="lora", lora=lora)
    in_place_updates(model).update(iter(requests))
    want = (base + 1.0 * (b @ a)).to(torch.bfloat16)
    assert torch.equal(model.state_dict()[f"{name}.weight"].cpu(), want)
    assert pointers(model) == where


@pytest.mark.gpu
def test_pinned_host_bytes_may_be_reused_as_soon_as_feed_tensor_returns(
    gpu_actor_dir: Path,
) -> None:
    # The contract of UpdateStager.feed_tensor for host bytes: copied before it returns, even
    # from page-locked memory (only the shm plane's registered mapping, held until the update
    # finishes, is copied by DMA later: held_host). One pinned buffer, overwritten per piece.
    model = LlamaForCausalLM.from_pretrained(gpu_actor_dir).to("cuda", torch.bfloat16)
    source = {k: v.float() for k, v in tiny_weights_like(model).items()}
    requests = list(update_weights_requests(source, target="actor", version=1, mode="full"))
    blob = torch.frombuffer(
        bytearray(b"".join(r.chunk.data for r in requests[1:])), dtype=torch.uint8
    )
    piece = 1 << 16
    reused = torch.empty(piece, dtype=torch.uint8).pin_memory()
    arena = staging_arena(model)
    with arena.lease():
        stager = UpdateStager(requests[0].header, model, None, arena=arena)
        for offset in range(0, len(blob), piece):
            size = min(piece, len(blob) - offset)
            reused[:size].copy_(blob[offset : offset + size])
            stager.feed_tensor(offset, reused[:size])
            reused.fill_(0xFF)  # the next piece's bytes would land here
        staged = stager.finish()
        staged.apply(model)
    assert_bits_equal(model.state_dict(), {k: v.to(torch.bfloat16) for k, v in source.items()})


def tiny_weights_like(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(41)
    return {k: torch.randn(v.shape, generator=generator).to(v.dtype).cuda()
            for k, v in model.state_dict().items()}  # fmt: skip


@pytest.mark.gpu
def test_a_cuda_model_over_the_device_limit_stages_in_pinned_host_memory(
    gpu_actor_dir: Path,
) -> None:
    model = LlamaForCausalLM.from_pretrained(gpu_actor_dir).to("cuda", torch.bfloat16)
    arena = StagingArena(device=torch.device("cuda"), pin_memory=True, device_limit_bytes=1)
    set_staging_arena(model, arena)
    where = pointers(model)
    source = {k: v.float() for k, v in tiny_weights_like(model).items()}
    update_in_place(model, make_requests(source))
    assert not arena.staged_on_device and arena.capacity_bytes > 0
    assert_bits_equal(model.state_dict(), {k: v.to(torch.bfloat16) for k, v in source.items()})
    assert pointers(model) == where


@pytest.mark.gpu
def test_a_server_engine_with_its_kv_cache_at_its_budget_still_stages_on_the_device(
    gpu_actor_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The memory plan: the engine's KV budget left one staging copy of the model, so with the
    # cache grown to the whole budget at a high utilization the update still stages on the
    # device, and weights + KV + staging stay inside the share.
    monkeypatch.setenv("ROLLSERVE_ENGINE_COMPILE", "0")
    utilization = 0.95
    model = LlamaForCausalLM.from_pretrained(gpu_actor_dir).to("cuda", torch.bfloat16)
    settings = GenerationSettings(path="rollserve", gpu_memory_utilization=utilization)
    adopt_settings(model, settings)
    torch.cuda.empty_cache()  # earlier tests' cached blocks are not this server's use
    engine = engine_for(model, settings)
    assert engine is not None and engine.capacity_tokens > 0
    arena = staging_arena(model)
    try:
        width = 64
        engine.cache.view(engine.cache.rows_for(width), width)  # the whole budget, allocated
        source = {k: v.cpu() for k, v in tiny_weights_like(model).items()}  # bf16: the wire
        update_in_place(model, make_requests(source))
        assert arena.staged_on_device
        assert arena.capacity_bytes <= staging_reserve_bytes(model) + 64 * KIB  # + alignment
        free, total = torch.cuda.mem_get_info()
        assert total - free <= utilization * total
        assert_bits_equal(model.state_dict(), source)
    finally:
        engine.cache.release()
        arena.release()
        torch.cuda.empty_cache()
