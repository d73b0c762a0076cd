"""Staging in place (server/weights/stream.py): a plane that holds the whole data section in
memory of the model's device (CUDA IPC buffers of a trainer) hands it over instead of copying
it into the staging arena; the checks read it there and apply copies it into the model.

On the CPU the stager runs its device path with a "device" arena on the CPU (as the device
staging tests do), so everything but the CUDA IPC mapping itself runs here: the bits applied,
no arena buffer taken, refusals that leave the model as it was, the cases that must fall back
to a staged copy, and no reference to the plane's memory left once the update is done. The
plane's own use of it (one span on the model's GPU) runs in tests/test_cuda_ipc.py (gpu).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator

import pytest
import torch
from helpers_weights import perturbed, state_hash, tiny_llama
from rollserve.client.protocol.errors import Cancelled, DeadlineExceeded, InvalidArgument
from rollserve.client.weights.update_file import prepare_update
from rollserve.server.config import ServerConfig
from rollserve.server.state import ServerState
from rollserve.server.weights import UpdateStager, WeightUpdates
from rollserve.server.weights import update as update_module
from rollserve.server.weights.arena import StagingArena, set_staging_arena
from rollserve.server.weights.pipeline import SlotRing
from rollserve.v1 import rollout_pb2 as pb
from torch.multiprocessing.reductions import StorageWeakRef

CPU = torch.device("cpu")


def _arena(device: str | None = "cpu") -> StagingArena:
    """A pipelined ("device") arena on the CPU, or a host arena (device None)."""
    ring = SlotRing(pin_memory=False, slots=3, slot_bytes=4093)
    return StagingArena(device=device, ring=ring)


def _file(weights: dict[str, torch.Tensor], **options: object) -> tuple[object, bytes, bytes]:
    """The update's header, its file's head, its data section."""
    update = prepare_update(weights, version=1, **options)  # type: ignore[arg-type]
    head, specs = update.layout()
    data = bytearray()
    for spec in specs:
        data += weights[spec.name].contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return update.header, head, bytes(data)


def _memory(data: bytes, storage_offset: int = 0) -> torch.Tensor:
    """The data section in memory of its own, `storage_offset` bytes into its storage."""
    backing = torch.zeros(storage_offset + len(data), dtype=torch.uint8)
    backing[storage_offset:] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return backing[storage_offset:]


def _stage(
    model: torch.nn.Module,
    arena: StagingArena | None,
    header: object,
    head: bytes,
    source: torch.Tensor,
    *,
    offer_offset: int | None = None,
    views: dict | None = None,
) -> tuple[UpdateStager, bool]:
    """Offer `source` in place, feed the head, then place it (or feed it when the stager did
    not take the offer); the stager, and whether it staged in place."""
    stager = UpdateStager(header, model, None, arena=arena)  # type: ignore[arg-type]
    offset = source.storage_offset() if offer_offset is None else offer_offset
    stager.offer_in_place(source.device, offset, views)
    lane = stager.lane(0, stager.options.total_bytes)
    lane.feed(0, head)
    in_place = lane.file_data.in_place
    if in_place:
        lane.place(source)
    else:
        lane.feed_tensor(len(head), source)
    return stager, in_place


def test_in_place_applies_the_same_bits_without_a_staging_buffer() -> None:
    model, trainer = tiny_llama(0), tiny_llama(1)
    weights = {name: t.detach().clone() for name, t in trainer.state_dict().items()}
    header, head, data = _file(weights)
    source = _memory(data, storage_offset=64)
    arena = _arena()
    stager, in_place = _stage(model, arena, header, head, source)
    assert in_place
    staged = stager.finish()
    assert staged.in_place and staged.on_device and staged.where == "in place"
    # The staged tensors are views of the plane's memory: nothing was copied.
    begin = source.data_ptr()
    for tensor in staged.tensors.values():
        if tensor.numel():
            assert begin <= tensor.data_ptr() < begin + len(source)
    assert arena.allocations == 0 and arena.capacity_bytes == 0
    pointers = {name: t.data_ptr() for name, t in model.state_dict().items()}
    staged.apply(model)
    assert state_hash(model) == state_hash(trainer)
    # Copied into the parameters' own storages (a device model is never rebound).
    assert {name: t.data_ptr() for name, t in model.state_dict().items()} == pointers
    timings = staged.timings
    assert timings is not None and "in_place" in timings.line()
    assert "arena_take" not in timings.line()


def test_a_plane_that_keeps_its_memory_keeps_the_views_of_it_for_the_same_head() -> None:
    """offer_in_place's `views` (kept CUDA IPC buffers): the next update that places the same
    memory under the same head stages the very same views, and applies what the memory holds
    now; other memory, or another head, gets views of its own."""
    model, trainer = tiny_llama(0), tiny_llama(1)
    arena = _arena()
    weights = {name: t.detach().clone() for name, t in trainer.state_dict().items()}
    header, head, data = _file(weights)
    source = _memory(data, storage_offset=64)
    views: dict = {}
    stager, _ = _stage(model, arena, header, head, source, views=views)
    first = stager.finish()
    first.apply(model)
    assert state_hash(model) == state_hash(trainer) and len(views) == 1
    # The trainer's next step, written into the same memory; the same head.
    moved = perturbed(trainer, seed=5)
    _, _, moved_data = _file(moved)
    source.copy_(torch.frombuffer(bytearray(moved_data), dtype=torch.uint8))
    header.version = 2  # type: ignore[attr-defined]
    stager, _ = _stage(model, arena, header, head, source, views=views)
    second = stager.finish()
    assert second.tensors is first.tensors  # no view made again
    second.apply(model)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, moved[name]), name
    # Other memory (a copy elsewhere) under the same head: views of that memory.
    elsewhere = _memory(moved_data, storage_offset=128)
    stager, _ = _stage(model, arena, header, head, elsewhere, views=views)
    third = stager.finish()
    assert third.tensors is not first.tensors
    begin = elsewhere.data_ptr()
    assert all(begin <= t.data_ptr() < begin + len(elsewhere) for t in third.tensors.values())
    # The same memory and head bytes, but the head checked anew (the model changed under the
    # remembered one): views of the new verified head.
    arena.forget_head()
    stager, _ = _stage(model, arena, header, head, elsewhere, views=views)
    assert stager.finish().tensors is not third.tensors
    # Another head (fewer tensors): its own views.
    partial = {"model.norm.weight": moved["model.norm.weight"] * 2}
    header, head, data = _file(partial, mode="partial")
    header.version = 4  # type: ignore[attr-defined]
    stager, _ = _stage(model, arena, header, head, _memory(data), views=views)
    fourth = stager.finish()
    assert list(fourth.tensors) == ["model.norm.weight"]
    fourth.apply(model)
    assert torch.equal(model.state_dict()["model.norm.weight"], partial["model.norm.weight"])


def test_bad_values_in_place_are_refused_and_the_model_keeps_its_weights() -> None:
    model, trainer = tiny_llama(0), tiny_llama(1)
    weights = {name: t.detach().clone() for name, t in trainer.state_dict().items()}
    name = "model.layers.1.mlp.up_proj.weight"
    weights[name][3, 5] = float("nan")
    header, head, data = _file(weights)
    before = state_hash(model)
    source = _memory(data)
    memory = StorageWeakRef(source.untyped_storage())
    stager, in_place = _stage(model, _arena(), header, head, source)
    assert in_place
    with pytest.raises(InvalidArgument, match=name) as refusal:
        stager.finish()
    assert state_hash(model) == before
    # The refusal (kept here, as a server's error handling may keep it a while) and its
    # traceback hold no reference to the memory once the stager let go of it (update.py does,
    # after every update): a trainer's is unmapped at the plane's exit.
    stager.let_go()
    del stager, source
    gc.collect()
    assert memory.expired(), "the refusal keeps the staged memory"
    assert refusal.value is not None


@pytest.mark.parametrize(
    ("case", "options", "storage_offset"),
    [
        ("an offset that misaligns 8-byte elements", {}, 4),
        ("a SHA-256 to verify (hashed as bytes are fed)", {"sha256": True}, 0),
    ],
)
def test_what_cannot_be_staged_in_place_is_staged_as_a_copy(
    case: str, options: dict, storage_offset: int
) -> None:
    model, trainer = tiny_llama(0), tiny_llama(1)
    weights = {name: t.detach().clone() for name, t in trainer.state_dict().items()}
    weights["model.norm.weight"] = weights["model.norm.weight"].double()  # an 8-byte dtype
    model.model.norm.double()
    header, head, data = _file(weights, **options)
    arena = _arena()
    stager, in_place = _stage(model, arena, header, head, _memory(data, storage_offset))
    assert not in_place, case
    staged = stager.finish()
    assert not staged.in_place and arena.allocations == 1
    staged.apply(model)
    _assert_holds(model, weights)


def _assert_holds(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    served = model.state_dict()
    for name, tensor in weights.items():
        assert torch.equal(served[name], tensor), name


@pytest.mark.parametrize("arena", [None, "host"])
def test_without_a_device_arena_nothing_is_staged_in_place(arena: str | None) -> None:
    # No arena (a bare stager) or a host arena: the device path that checks and applies in
    # place is not there.
    model, trainer = tiny_llama(0), tiny_llama(1)
    weights = {name: t.detach().clone() for name, t in trainer.state_dict().items()}
    header, head, data = _file(weights)
    staging = None if arena is None else _arena(device=None)
    stager, in_place = _stage(model, staging, header, head, _memory(data))
    assert not in_place
    stager.finish().apply(model)
    assert state_hash(model) == state_hash(trainer)


def test_memory_that_is_not_what_was_offered_is_refused() -> None:
    model = tiny_llama(0)
    weights = perturbed(model, seed=3)
    header, head, data = _file(weights)
    stager = UpdateStager(header, model, None, arena=_arena())  # type: ignore[arg-type]
    stager.offer_in_place(CPU, 0)
    lane = stager.lane(0, stager.options.total_bytes)
    lane.feed(0, head)
    assert lane.file_data.in_place
    with pytest.raises(InvalidArgument, match="were offered"):
        lane.place(_memory(data[:-8]))  # 8 bytes short
    with pytest.raises(InvalidArgument, match="were offered"):
        lane.place(_memory(data, storage_offset=8))  # another place than offered


class HeldMemoryPlane:
    """A data plane that holds the data section in memory of its own, as the CUDA IPC plane
    holds a trainer's buffer: offered in place before the head, placed after it. At its exit
    it drops its own reference and records whether anything else still holds the memory (the
    CUDA IPC plane closes the handles there: the memory must be unmapped then, not at the
    garbage collector's next run)."""

    name = "held-memory"

    def __init__(self, head: bytes, data: bytes) -> None:
        self._head = head
        self._source: torch.Tensor | None = _memory(data, storage_offset=8)
        self.memory = StorageWeakRef(self._source.untyped_storage())
        self.in_place = False
        self.referenced_at_exit: bool | None = None

    def __enter__(self) -> HeldMemoryPlane:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._source = None
        self.referenced_at_exit = not self.memory.expired()

    def receive(self, stager: UpdateStager, requests: object) -> None:
        assert self._source is not None
        stager.offer_in_place(CPU, self._source.storage_offset())
        lane = stager.lane(0, stager.options.total_bytes)
        lane.feed(0, self._head)
        self.in_place = lane.file_data.in_place
        if self.in_place:
            lane.place(self._source)
        else:  # the stager took no offer (a host arena): its bytes are staged as a copy
            lane.feed_tensor(len(self._head), self._source)

    def finished(self, response: object) -> None:
        return None


class OnePlane:
    """Planes that pick one plane for every update."""

    device = CPU  # the models'

    def __init__(self, plane: HeldMemoryPlane) -> None:
        self.plane = plane

    def pick(self, header: object) -> HeldMemoryPlane:
        return self.plane

    def close(self, wait_s: float = 0.0) -> bool:
        return True


@pytest.fixture
def no_garbage_collector() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def test_no_reference_to_the_memory_outlives_the_plane(no_garbage_collector: None) -> None:
    # Through the server's updater (weights/update.py), an applied update and a refused one:
    # neither the arena (its remembered head and views), nor the stager and its lanes (which
    # refer to each other), nor a refusal's traceback may keep the plane's memory past its exit.
    model, trainer = tiny_llama(0), tiny_llama(1)
    set_staging_arena(model, _arena())
    updates = WeightUpdates(
        {"actor": model},
        ServerState(ServerConfig()),
        OnePlane(None),
        lambda role, apply: apply(),  # type: ignore[arg-type]
    )
    for version, bad in ((1, False), (2, True), (3, False)):
        weights = {name: t.detach().clone() for name, t in trainer.state_dict().items()}
        if bad:
            weights["lm_head.weight"][0, 0] = float("inf")
        header, head, data = _file(weights)
        header.version = version  # type: ignore[attr-defined]
        plane = HeldMemoryPlane(head, data)
        updates.planes = OnePlane(plane)  # type: ignore[assignment]
        requests = iter([pb.UpdateWeightsRequest(header=header)])
        if bad:
            with pytest.raises(InvalidArgument, match="lm_head.weight") as refusal:
                updates.update(requests)
            assert refusal.value is not None  # the refusal, kept alive while we look
        else:
            assert updates.update(requests).version == version
        assert plane.in_place
        assert plane.referenced_at_exit is False, f"v{version}: the memory outlived the plane"
    assert state_hash(model) == state_hash(trainer)
    # ... nor an update refused at its swap because its call had ended (update.check_call).
    ended = EndingCall()
    ended.active = False
    header, head, data = _file(perturbed(model, seed=4))
    header.version = 4  # type: ignore[attr-defined]
    plane = HeldMemoryPlane(head, data)
    updates.planes = OnePlane(plane)  # type: ignore[assignment]
    with pytest.raises(Cancelled) as refusal:
        updates.update(iter([pb.UpdateWeightsRequest(header=header)]), ended)
    assert refusal.value is not None and plane.in_place
    assert plane.referenced_at_exit is False, "the ended call's refusal kept the memory"
    assert state_hash(model) == state_hash(trainer)


class EndingCall:
    """An update's gRPC call (update.Call) whose end the test decides: `at_swap` says how it
    stands once the update's swap comes (active, seconds left)."""

    def __init__(self) -> None:
        self.active, self.remaining = True, 60.0
        self.at_swap = (True, 60.0)

    def is_active(self) -> bool:
        return self.active

    def time_remaining(self) -> float:
        return self.remaining

    def swap(self, role: str, apply: Callable[[], object]) -> object:
        """WeightUpdates' swap: the wait for the engine, during which the call may end."""
        self.active, self.remaining = self.at_swap
        return apply()


@pytest.mark.parametrize("arena", ["cpu", None], ids=["in place", "staged copy"])
def test_an_update_whose_call_ends_before_its_swap_is_not_applied(arena: str | None) -> None:
    """The swap waits for the experience job then running; the trainer's call may end
    meanwhile (its deadline, a cancel). It was told the update failed: the weights must not
    change behind its back, and staged in place the bytes are its memory, which it may now
    reuse: with too little time left for apply's reads, nothing is applied either."""
    model, trainer = tiny_llama(0), tiny_llama(1)
    set_staging_arena(model, _arena(arena))
    call, state = EndingCall(), ServerState(ServerConfig())
    updates = WeightUpdates({"actor": model}, state, OnePlane(None), call.swap)  # type: ignore[arg-type]
    weights = {name: t.detach().clone() for name, t in trainer.state_dict().items()}
    header, head, data = _file(weights)
    before = state_hash(model)

    def update(at_swap: tuple[bool, float]) -> object:
        plane = HeldMemoryPlane(head, data)
        updates.planes = OnePlane(plane)  # type: ignore[assignment]
        call.active, call.remaining, call.at_swap = True, 60.0, at_swap
        try:
            return updates.update(iter([pb.UpdateWeightsRequest(header=header)]), call)
        finally:
            assert plane.in_place == (arena is not None)

    with pytest.raises(Cancelled, match="call ended"):
        update((False, 0.0))
    assert state_hash(model) == before and state.policy_version("actor") == 0
    short = (True, update_module.IN_PLACE_MARGIN_S / 2)
    if arena is not None:
        with pytest.raises(DeadlineExceeded, match="staged in place"):
            update(short)
        assert state_hash(model) == before and state.policy_version("actor") == 0
        update((True, 60.0))
    else:
        update(short)  # a staged copy is the server's own memory: time enough
    assert state_hash(model) == state_hash(trainer) and state.policy_version("actor") == 1
