"""Staging: an UpdateWeights stream's bytes into a verified StagedUpdate; then apply it.

Staging runs on the gRPC handler thread and never writes the model: the bytes land in one arena
(at most one staging copy of the target: in host memory for a model on the CPU, on the device
for a model on a CUDA device; arena.py states the bound), and every check runs before the
StagedUpdate exists. apply runs on the engine thread between batches, which is what
makes the swap atomic for generation. The server stages into the target's reusable StagingArena
(arena.py), leased for the whole stage-verify-apply, because the staged tensors are its views;
update.py runs that sequence.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

from ...client.protocol.errors import FailedPrecondition, InvalidArgument
from ...client.protocol.wire import MalformedRequest, WireChunk
from ...v1 import rollout_pb2 as pb
from .arena import StagingArena
from .copy_runs import CopyPlans, copy_all
from .header import DEFAULT_MAX_HEADER_BYTES
from .lora import LoraState, apply_lora
from .options import UpdateOptions, update_options
from .spec import TargetTensor, live_tensors, model_spec
from .stream import Lane, SafetensorsStager
from .timings import UpdateTimings
from .verify import UpdateChecks, UpdatePlan

__all__ = [
    "AppliedUpdate",
    "StagedUpdate",
    "UpdateStager",
    "iter_chunks",
    "iter_shm_written",
    "read_header",
    "receive_head_only",
]


# The copies of a device apply, merged into runs (copy_runs.py): planned once per model and head.
_COPY_PLANS = CopyPlans()


@dataclass(frozen=True)
class AppliedUpdate:
    """What apply did: tensors of the file applied, and the file's size in bytes."""

    tensors: int
    bytes: int


@dataclass(frozen=True)
class StagedUpdate:
    """A fully received and verified update, waiting in its arena to be applied."""

    target: int  # pb.ModelRole as sent (UNSPECIFIED means the actor; the servicer resolves it)
    version: int
    options: UpdateOptions
    plan: UpdatePlan
    tensors: Mapping[str, torch.Tensor]  # wire dtype and shape, views into one arena
    lora_state: LoraState | None
    arena: StagingArena | None = None  # the leased arena the tensors are views of
    on_device: bool = False  # the tensors are in a device arena (pipeline.py)
    in_place: bool = False  # ... or views of the plane's own device memory (stream.py)
    timings: UpdateTimings | None = None  # the update's timings: apply adds its parts

    @property
    def total_bytes(self) -> int:
        return self.options.total_bytes

    @property
    def where(self) -> str:
        """Where the tensors were staged, as the update's log line says it."""
        if self.in_place:
            return "in place"
        return "on the device" if self.on_device else "in host memory"

    def apply(self, model: torch.nn.Module) -> AppliedUpdate:
        """Copy the staged tensors into the model (casting floats to each parameter's dtype).

        All validation happened while staging, and the pre-pass below re-checks that the model
        still has every target, before the first write. Every write goes into the existing
        parameter storages (never a rebinding on a device: the generation engine's CUDA graphs
        read those storages), except the adoption of a CPU arena (arena.py).

        Temporaries, the only failure left: staged in host memory, each tensor is cast on the
        host (one tensor-sized host temporary) and copied, so nothing is allocated on the
        device. Staged on the device, each tensor is copied device to device and copy_ casts in
        its kernel: no temporary at all; the copies are waited for before returning, so the
        arena is free for the next update. A LoRA merge runs on the host either way (the
        factors, a few MB, are copied there first): one weight-sized host temporary.
        """
        started_s = time.perf_counter()
        try:
            # A LoRA merge and the adoption check read tensors beyond the targets.
            every_tensor = not self.on_device or self.options.mode == pb.UPDATE_MODE_LORA
            model_tensors = _resolve(model, self._targets(), every_tensor=every_tensor)
        except FailedPrecondition:
            if self.arena is not None:  # its remembered head was planned on the old model
                self.arena.forget_head()
            raise
        resolved_s = time.perf_counter()
        copies = len(self.plan.copies)
        devices: set[torch.device] = set()  # where apply's copies run, to wait for them
        with torch.no_grad():
            if self.options.mode == pb.UPDATE_MODE_LORA:
                assert self.lora_state is not None and self.options.lora is not None
                if not self.lora_state.names() <= model_tensors.keys():
                    raise FailedPrecondition("the LoraState belongs to another model")
                factors = self.tensors
                if self.on_device:  # merged on the host, as from a host arena (bit for bit)
                    factors = {name: tensor.cpu() for name, tensor in self.tensors.items()}
                    devices = {tensor.device for tensor in self.tensors.values()}
                apply_lora(
                    model_tensors, self.plan.lora, factors, self.lora_state, self.options.lora
                )
            elif self._adoptable(model_tensors):
                for entry, target in self.plan.copies:
                    model_tensors[target.name].data = self.tensors[entry.name]
                self._forget_lora_bases()
                if self.arena is not None:
                    self.arena.adopted()
            else:
                pairs = [
                    (model_tensors[target.name], self.tensors[entry.name])
                    for entry, target in self.plan.copies
                ]
                if self.on_device:
                    merged = _COPY_PLANS.copies(model, self.plan, pairs)
                    copies = copy_all(pairs, merged)
                    devices = merged.devices
                else:
                    for destination, staged in pairs:
                        _copy_into(destination, staged)
                self._forget_lora_bases()
            launched_s = time.perf_counter()
            if self.on_device:
                _wait_for_copies(devices)
        if self.timings is not None:
            self.timings.add("apply_resolve", resolved_s - started_s)
            self.timings.add("apply_launch", launched_s - resolved_s, copies)
            self.timings.add("apply_wait", time.perf_counter() - launched_s)
        return AppliedUpdate(tensors=len(self.tensors), bytes=self.total_bytes)

    def _adoptable(self, model_tensors: Mapping[str, torch.Tensor]) -> bool:
        """Whether the model's tensors can become views of the staged ones instead of copies
        (arena.py, "Adoption"): a full update on the CPU, every tensor of the model written,
        wire dtype = model dtype (no cast)."""
        if self.options.mode != pb.UPDATE_MODE_FULL or self.on_device:
            return False
        written = set()
        for entry, target in self.plan.copies:
            live = model_tensors[target.name]
            if live.device.type != "cpu" or self.tensors[entry.name].dtype != live.dtype:
                return False
            written.add(id(live))
        # Tied weights are one tensor under two names: all of them must be written.
        return all(id(tensor) in written for tensor in model_tensors.values())

    def _forget_lora_bases(self) -> None:
        if not self.lora_state:  # None, or no adapter merged (a loop of 291 lookups saved)
            return
        for _, target in self.plan.copies:
            # A written weight is the new truth; a later adapter merges onto it.
            self.lora_state.forget(target.name)

    def _targets(self) -> list[TargetTensor]:
        return [target for _, target in self.plan.copies] + [t.weight for t in self.plan.lora]


def _resolve(
    model: torch.nn.Module, targets: list[TargetTensor], *, every_tensor: bool
) -> dict[str, torch.Tensor]:
    """The model's live tensors by name (the targets', or with every_tensor all of them), after
    checking the targets still match what was verified."""
    live = None if every_tensor else live_tensors(model, [target.name for target in targets])
    if live is None:
        live = model.state_dict(keep_vars=True)
    for target in targets:
        tensor = live.get(target.name)
        if tensor is None or tensor.shape != target.shape or tensor.dtype != target.dtype:
            raise FailedPrecondition(
                f"{target.name}: the model changed after the update was staged"
            )
    return live


def _copy_into(destination: torch.Tensor, staged: torch.Tensor) -> None:
    if staged.device.type != "cpu":
        destination.copy_(staged)  # from a device arena: copy_ casts in its kernel, no temporary
        return
    # Cast on the host (a temporary the size of one tensor) so the device needs no temporaries.
    source = staged if staged.dtype == destination.dtype else staged.to(destination.dtype)
    destination.copy_(source)


def _wait_for_copies(devices: Iterable[torch.device]) -> None:
    """Wait for the device-to-device copies out of a device arena (issued on this thread's
    current stream on each of `devices`): once apply returns, the next update may rewrite the
    arena."""
    for device in devices:
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()


class UpdateStager:
    """Stages one update chunk by chunk; for servicers that parse the wire themselves."""

    def __init__(
        self,
        header: pb.WeightsHeader,
        model: torch.nn.Module,
        lora_state: LoraState | None,
        *,
        max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
        arena: StagingArena | None = None,
        timings: UpdateTimings | None = None,
    ) -> None:
        # arena: a leased StagingArena to stage into (held until apply is done); None: fresh.
        # timings: the update's (update.py); planes and the arena's pipeline add to it.
        self.timings = UpdateTimings() if timings is None else timings
        self._options = update_options(header)
        if self._options.mode == pb.UPDATE_MODE_LORA and lora_state is None:
            raise ValueError("a LoraState is required to stage a LoRA update")
        self._lora_state = lora_state
        self._arena = arena
        # The model's spec is read only when a head is checked (a repeated head reuses its plan).
        self._checks = UpdateChecks(lambda: model_spec(model), self._options)
        self._stager = SafetensorsStager(
            self._options.total_bytes,
            self._checks,
            max_header_bytes=max_header_bytes,
            sha256_hex=self._options.sha256,
            arena=arena,
            timings=self.timings,
        )

    @property
    def options(self) -> UpdateOptions:
        return self._options

    @property
    def head_parsed(self) -> bool:
        """Whether the file's head arrived (names, shapes and dtypes are verified then)."""
        return self._stager.head_parsed

    def feed(self, offset: int, data: bytes | memoryview, crc32: int | None = None) -> None:
        """The next chunk of a single ordered stream (one lane over the whole file)."""
        if self._stager.head_parsed:
            self._stager.feed(offset, data, crc32)
            return
        self._stager.feed(offset, data, crc32)
        if self._stager.head_parsed:  # fed on the handler thread: the head's phase ends here
            self.timings.lap("head")

    def feed_tensor(self, offset: int, data: torch.Tensor) -> None:
        """The next bytes of the single ordered stream (the same contract as `feed`, no crc32)
        as a 1-D contiguous uint8 tensor on any device (CPU or CUDA). Lane.feed_tensor is the
        form for one lane of several.

        Into a device arena (a CUDA model), CUDA bytes are copied device to device on the
        arena's copy stream, after the caller's current stream (no host round trip); the copy
        is asynchronous, so they must stay unchanged until `finish` returns (the stager keeps
        them alive until then). Host bytes are copied before this returns. The head's bytes
        are parsed on the host (a small device-to-host copy). With header.sha256, CUDA bytes
        are hashed through a synchronous host copy of each piece: a device-to-host pass over
        the file, plus the hash's own ~1-2 GB/s on one core, on top of the copy; a trainer that
        wants device speed leaves sha256 off.
        """
        self._stager.feed_tensor(offset, data)

    def lane(self, begin: int, end: int) -> Lane:
        """A lane for file bytes [begin, end), fed in order by one thread (stream.py)."""
        return self._stager.lane(begin, end)

    def offer_in_place(
        self, device: torch.device, storage_offset: int, views: dict | None = None
    ) -> None:
        """Before the head: the plane will hold the whole data section on `device` and may hand
        it over in place (stream.py, `SafetensorsStager.offer_in_place`, `Lane.place`);
        `views`: where the plane keeps the staged views with that memory (None: nowhere)."""
        self._stager.offer_in_place(device, storage_offset, views)

    def fail(self, error: BaseException) -> None:
        """Stop every lane: the update failed (lanes waiting for the head wake up and raise)."""
        self._stager.fail(error)

    def let_go(self) -> None:
        """After the update (applied or failed): no reference to memory staged in place."""
        self._stager.let_go()

    def finish(self) -> StagedUpdate:
        staged = self._stager.finish()
        assert self._checks.plan is not None
        return StagedUpdate(
            target=self._options.target,
            version=self._options.version,
            options=self._options,
            plan=self._checks.plan,
            tensors=staged.tensors,
            lora_state=self._lora_state,
            arena=self._arena,
            on_device=staged.on_device,
            in_place=staged.in_place,
            timings=self.timings,
        )


# What a stream yields: protobuf messages (in-process callers, the generated deserializer) or,
# through the server's wire deserializer (handlers.py), headers as protobuf and chunks as views.
Request = pb.UpdateWeightsRequest | WireChunk | MalformedRequest


def read_header(stream: Iterator[Request]) -> pb.WeightsHeader:
    """The first message of an UpdateWeights stream, which must be the header."""
    first = next(stream, None)
    if isinstance(first, MalformedRequest):
        raise InvalidArgument(f"malformed UpdateWeightsRequest: {first.reason}")
    if not isinstance(first, pb.UpdateWeightsRequest) or first.WhichOneof("payload") != "header":
        raise InvalidArgument("the first UpdateWeights message must be a header")
    return first.header


def iter_chunks(stream: Iterator[Request]) -> Iterator[tuple[int, bytes | memoryview, int | None]]:
    """(offset, data, crc32) of every remaining message, which must all be chunks."""
    for request in stream:
        if type(request) is WireChunk:  # the server's fast path: data is a view, not a copy
            yield request.offset, request.data, request.crc32
        elif isinstance(request, MalformedRequest):
            raise InvalidArgument(f"malformed UpdateWeightsRequest: {request.reason}")
        else:
            kind = request.WhichOneof("payload")
            if kind != "chunk":
                raise InvalidArgument(_UNEXPECTED.get(kind, "an empty message"))
            chunk = request.chunk
            # upb copies `data` on every access: read it once.
            yield chunk.offset, chunk.data, chunk.crc32 if chunk.HasField("crc32") else None


def receive_head_only(stager: UpdateStager, requests: Iterator[Request], plane: str) -> Lane:
    """A lane over the whole file, fed with the stream's chunks, which must be the file's head
    and nothing else: the planes whose data section comes another way (a broadcast, CUDA IPC)
    then feed the lane from its file_data.data_start on."""
    lane = stager.lane(0, stager.options.total_bytes)
    for offset, data, crc32 in iter_chunks(requests):
        lane.feed(offset, data, crc32)
    if not stager.head_parsed or lane.position != lane.file_data.data_start:
        raise InvalidArgument(
            f"the stream of a {plane} update must carry the file's head and nothing else (it "
            f"carried {lane.position} bytes)"
        )
    return lane


def iter_shm_written(stream: Iterator[Request]) -> Iterator[int]:
    """SharedMemoryWritten.bytes of every remaining message, which must all be shm_written."""
    for request in stream:
        if isinstance(request, MalformedRequest):
            raise InvalidArgument(f"malformed UpdateWeightsRequest: {request.reason}")
        kind = "chunk" if type(request) is WireChunk else request.WhichOneof("payload")
        if kind != "shm_written":
            raise InvalidArgument(
                "an update from a streamed shared-memory file carries shm_written messages, "
                f"no {kind or 'empty message'}"
            )
        yield request.shm_written.bytes


_UNEXPECTED = {
    "header": "a second header in one UpdateWeights stream",
    "shm_written": "shm_written belongs to an update from shared memory with streamed set",
}
