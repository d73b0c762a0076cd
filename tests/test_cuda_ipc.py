"""Transport "cuda_ipc": a trainer's CUDA tensors handed to a CUDA server on the same host as CUDA
IPC handles, copied device to device.

CPU (runs everywhere): the protocol's refusals against a real server: a CPU server neither lists
nor takes cuda_ipc (FAILED_PRECONDITION), malformed sources are INVALID_ARGUMENT and another host
FAILED_PRECONDITION, before anything is opened and with the old weights serving; the client
refuses CPU tensors itself, and "auto" never picks cuda_ipc for them. The buffers a server keeps
open between updates (KeptIpcBuffers, with CPU storages standing in for opened ones): per role
and key, replaced by the role's next update, released after KEEP_S idle and at shutdown.

GPU (marked `gpu`): a trainer in a spawned process updates a CUDA server over cuda_ipc: bit-equal
weights in the parameters' own storages, "auto" picks it, a flattened buffer is one buffer, and a
trainer that exported its handles and exited before the server opened them is refused with the
old weights serving; the same buffer sent again is not opened again (kept).
"""

from __future__ import annotations

import logging
import multiprocessing
import re
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from helpers_weights import perturbed, stand_in_for_cuda, state_hash
from rollserve.client import RolloutClient
from rollserve.client.protocol.cuda_ipc import MAX_BUFFERS, MAX_SPANS, cuda_ipc_host_id
from rollserve.client.protocol.wire import update_weights_callable
from rollserve.client.weights.update_file import UpdateFile, prepare_update
from rollserve.server.config import ServerConfig
from rollserve.server.models import ModelSet, load_models
from rollserve.server.models.default_model import TinyModelSpec, save_tiny_causal_lm
from rollserve.server.serving.app import RolloutServer
from rollserve.server.weights.cuda_ipc import (
    CUDA_MALLOC_HANDLE,
    KEPT_UPDATES,
    KeptIpcBuffers,
    keepable,
    keeps_buffers,
)
from rollserve.server.weights.planes import Planes, offered_transports
from rollserve.v1 import rollout_pb2 as pb
from torch.multiprocessing.reductions import StorageWeakRef

WAIT_S = 30.0
SPEC = TinyModelSpec()


@pytest.fixture(scope="module")
def actor_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_causal_lm(tmp_path_factory.mktemp("cuda-ipc-actor"), SPEC)


def _config(**overrides: object) -> ServerConfig:
    return ServerConfig(**{"host": "127.0.0.1", "port": 0, "device": "cpu", "metrics_port": 0,
                           **overrides})  # fmt: skip


# ---- CPU: the protocol and its refusals ----------------------------------------------------------


@pytest.fixture(scope="module")
def cpu_models(actor_dir: Path) -> ModelSet:
    return load_models(ServerConfig(device="cpu", actor=str(actor_dir)))


@pytest.fixture(scope="module")
def cpu_server(cpu_models: ModelSet) -> Iterator[RolloutServer]:
    with RolloutServer(_config(), models=cpu_models) as running:
        yield running


def _update(models: ModelSet, version: int = 1) -> tuple[UpdateFile, int]:
    """A full update of the actor (CPU tensors) and where its data section begins."""
    update = prepare_update(perturbed(models.actor.module, seed=version), version=version)
    return update, len(update.layout()[0])


def _buffer(storage_bytes: int, **fields: object) -> pb.CudaIpcBuffer:
    """A well-formed buffer (its handles name nothing: none of these updates opens one)."""
    values: dict[str, object] = dict(
        device_uuid="0" * 32, device=0, handle=b"\x01" * 64, storage_bytes=storage_bytes,
        storage_offset=0, ref_counter_handle=b"/torch_1_2_3", ref_counter_offset=0,
        event_handle=b"\x02" * 64, event_sync_required=True,
    )  # fmt: skip
    values.update(fields)
    return pb.CudaIpcBuffer(**values)


def _source(update: UpdateFile, data_start: int, **fields: object) -> pb.CudaIpcSource:
    """A well-formed source: one buffer holding the data section, one span over it."""
    data_bytes = update.total_bytes - data_start
    source = pb.CudaIpcSource(**{"host_id": cuda_ipc_host_id(), **fields})
    source.buffers.append(_buffer(data_bytes))
    source.spans.add(begin=data_start, end=update.total_bytes, buffer=0, offset=0)
    return source


def _send(server: RolloutServer, update: UpdateFile, source: pb.CudaIpcSource) -> object:
    """The cuda_ipc stream a trainer sends: the header with `source`, then the file's head."""
    header = pb.WeightsHeader()
    header.CopyFrom(update.header)
    header.cuda_ipc.CopyFrom(source)
    with grpc.insecure_channel(server.address) as channel:
        call = update_weights_callable(channel)
        return call(update.messages(header, 0, len(update.layout()[0])), timeout=WAIT_S)


def _refused(server: RolloutServer, update: UpdateFile, source: pb.CudaIpcSource) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        _send(server, update, source)
    return caught.value


def test_a_cpu_server_neither_lists_nor_takes_cuda_ipc(
    cpu_models: ModelSet, cpu_server: RolloutServer
) -> None:
    assert "cuda_ipc" in ServerConfig().weight_transports.split(",")  # on by default
    flags = ServerConfig.from_args(["--weight-transports", "CUDA_IPC, shm"], {})
    assert flags.weight_transports == "grpc,shm,cuda_ipc"
    assert offered_transports("grpc,shm,dist,cuda_ipc", torch.device("cpu")) == [
        "grpc", "shm", "dist",
    ]  # fmt: skip
    with RolloutClient(cpu_server.address, timeout_s=WAIT_S) as client:
        assert "cuda_ipc" not in client.health().weight_transports
    before = state_hash(cpu_models.actor.module)
    update, data_start = _update(cpu_models)
    error = _refused(cpu_server, update, _source(update, data_start))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error.details().startswith("cuda_ipc: ") and "cpu" in error.details()
    assert state_hash(cpu_models.actor.module) == before


def test_an_update_refused_before_it_is_staged_gives_back_the_trainers_counters(
    cpu_models: ModelSet, cpu_server: RolloutServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch keeps a shared CUDA storage's memory while its ref counter (set to 1 by the
    trainer's `_share_cuda_`) is above 0, and the client hands each counter over once: an
    update refused before its plane opened anything still gives it back, or the trainer's
    memory stays pinned for its life. Here on a server whose models are not on CUDA, on one
    that does not take cuda_ipc, and as the third update at once (the plane's own refusals
    after it is entered: the gpu tests)."""
    from rollserve.server.weights import cuda_ipc

    released: list[tuple[object, ...]] = []
    # torch's own call needs a CUDA build (a counter is a host file of the trainer's)
    monkeypatch.setattr(
        torch.UntypedStorage,
        "_release_ipc_counter",
        lambda *args, device=None: released.append(args),
    )
    before = state_hash(cpu_models.actor.module)
    update, data_start = _update(cpu_models)
    source = _source(update, data_start)
    error = _refused(cpu_server, update, source)
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, error.details()
    assert released == [(b"/torch_1_2_3", 0)]
    released.clear()
    monkeypatch.setattr(cuda_ipc, "can_open_cuda_ipc", lambda device: True)  # as on CUDA
    error = _refused(cpu_server, update, source)  # ... whose --weight-transports lack it
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, error.details()
    assert "does not accept" in error.details() and released == [(b"/torch_1_2_3", 0)]
    released.clear()
    assert cpu_server.updates is not None
    planes = cpu_server.updates.planes
    monkeypatch.setattr(planes, "sources", planes.sources | {"cuda_ipc"})
    slots = cpu_server.updates._update_slots  # one update streaming, one waiting
    assert slots.acquire(blocking=False) and slots.acquire(blocking=False)
    try:
        error = _refused(cpu_server, update, source)
    finally:
        slots.release()
        slots.release()
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
    assert released == [(b"/torch_1_2_3", 0)]
    assert state_hash(cpu_models.actor.module) == before


def _tiled(update: UpdateFile, data_start: int, cuts: list[tuple[int, int]]) -> pb.CudaIpcSource:
    """A source whose spans are `cuts` ((begin, end) relative to the data section), one
    buffer."""
    source = _source(update, data_start)
    del source.spans[:]
    for begin, end in cuts:
        source.spans.add(begin=data_start + begin, end=data_start + end, buffer=0, offset=begin)
    return source


def test_malformed_sources_are_refused_before_anything_is_opened(
    cpu_models: ModelSet, cpu_server: RolloutServer
) -> None:
    update, data_start = _update(cpu_models)
    data_bytes = update.total_bytes - data_start
    half = data_bytes // 2
    too_many = _source(update, data_start)
    too_many.buffers.extend([_buffer(16)] * MAX_BUFFERS)
    many_spans = _source(update, data_start)
    del many_spans.spans[:]
    step = data_bytes // (MAX_SPANS + 1)  # small steps: more than MAX_SPANS spans
    for begin in range(0, data_bytes, step):
        end = min(begin + step, data_bytes)
        many_spans.spans.add(begin=data_start + begin, end=data_start + end, buffer=0, offset=begin)
    assert len(many_spans.spans) > MAX_SPANS
    out_of_buffer = _source(update, data_start)
    out_of_buffer.spans[0].offset = 8  # the span runs 8 bytes past the buffer's end
    wrong_buffer = _source(update, data_start)
    wrong_buffer.spans[0].buffer = 1
    past_the_file = _tiled(update, data_start, [(0, half), (half, data_bytes + 8)])
    in_the_head = _source(update, data_start)
    in_the_head.spans[0].begin = 4

    def bad_buffer(**fields: object) -> pb.CudaIpcSource:
        source = _source(update, data_start)
        source.buffers[0].CopyFrom(_buffer(**{"storage_bytes": data_bytes, **fields}))
        return source

    unused = _source(update, data_start)
    unused.buffers.append(_buffer(16))
    cases = {
        "a gap": (_tiled(update, data_start, [(0, half), (half + 8, data_bytes)]), "a gap"),
        "an overlap": (_tiled(update, data_start, [(0, half), (half - 8, data_bytes)]), "overlap"),
        "short": (_tiled(update, data_start, [(0, half)]), "not at total_bytes"),
        "empty span": (_tiled(update, data_start, [(0, 0), (0, data_bytes)]), "not above"),
        "past the file": (past_the_file, "past total_bytes"),
        "in the head": (in_the_head, "inside the file's head"),
        "out of its buffer": (out_of_buffer, "not inside buffers[0]"),
        "no such buffer": (wrong_buffer, "there are 1 buffers"),
        "too many buffers": (too_many, f"at most {MAX_BUFFERS}"),
        "too many spans": (many_spans, f"at most {MAX_SPANS}"),
        "unused buffer": (unused, "no span reads it"),
        "bad uuid": (bad_buffer(device_uuid="GPU-0"), "device_uuid"),
        "no handle": (bad_buffer(handle=b""), "handle"),
        "counter outside /dev/shm": (bad_buffer(ref_counter_handle=b"/../etc/x"), "ref_counter"),
        "counter slot": (bad_buffer(ref_counter_offset=10_000), "ref_counter_offset"),
        "short event": (bad_buffer(event_handle=b"\x00" * 8), "event_handle"),
        "empty storage": (bad_buffer(storage_bytes=0), "storage_bytes"),
    }
    before = state_hash(cpu_models.actor.module)
    for name, (source, reason) in cases.items():
        error = _refused(cpu_server, update, source)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, error.details())
        assert reason in error.details(), (name, error.details())
    other_host = _source(update, data_start, host_id="another-boot/4026531836")
    error = _refused(cpu_server, update, other_host)
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "another host" in error.details()
    with RolloutClient(cpu_server.address, timeout_s=WAIT_S) as client:
        assert client.health().policy_version == 0
    assert state_hash(cpu_models.actor.module) == before


def test_the_client_refuses_cpu_tensors_and_auto_never_picks_cuda_ipc_for_them(
    cpu_models: ModelSet, cpu_server: RolloutServer
) -> None:
    actor = cpu_models.actor.module
    with RolloutClient(cpu_server.address, timeout_s=WAIT_S) as client:
        version = client.health().policy_version
        with pytest.raises(ValueError, match="CUDA tensors only"):
            client.update_weights(perturbed(actor, seed=3), version=version + 1,
                                  transport="cuda_ipc")  # fmt: skip
        assert client.health().policy_version == version  # nothing was sent
        result = client.update_weights(perturbed(actor, seed=3), version=version + 1)
        assert result.transport == ("shm" if cuda_ipc_host_id() else "grpc")


# ---- GPU: a trainer process updates a CUDA server ------------------------------------------------


def _trainer(commands: multiprocessing.Queue, results: multiprocessing.Queue) -> None:
    """A trainer process (spawned), one client across commands; results gets (transport,
    version, storages) of each update, or the error's text.

    ("update", address, path, version, transport, flat, mode): load CUDA weights from a file
    (flattened into one buffer if flat) and send them. ("tied", address, path, version, names):
    the same, flattened, with the file's tensors of `names` one tensor (the first's), as a tied
    model's state dict holds them; sent over cuda_ipc. ("again", version, scale): scale the
    same weights in place (an optimizer step on the same storages) and send them over
    cuda_ipc. ("export", path, version): results gets the encoded messages of a cuda_ipc update
    whose handles this process exports, then the process exits before anyone opens them.
    """
    from rollserve.client.weights.cuda_ipc import export_cuda_ipc
    from rollserve.client.weights.flat_weights import flatten_weights
    from safetensors.torch import load_file

    torch.cuda.set_device(0)
    client: RolloutClient | None = None
    weights: dict[str, torch.Tensor] = {}

    def connected(address: str) -> RolloutClient:
        nonlocal client
        if client is not None and client.target != address:
            client.close()
            client = None
        if client is None:
            client = RolloutClient(address, timeout_s=WAIT_S)
        return client

    while (command := commands.get()) is not None:
        try:
            if command[0] == "export":
                _, path, version = command
                weights = {k: v.cuda() for k, v in load_file(path).items()}
                update = prepare_update(weights, version=version)
                export = export_cuda_ipc(update)
                header = pb.WeightsHeader()
                header.CopyFrom(update.header)
                header.cuda_ipc.CopyFrom(export.source)
                results.put(list(update.messages(header, 0, len(update.layout()[0]))))
                return  # exits with the handles unopened: the memory goes with the process
            pack = False  # an "update" command's 8th item, when given: pack=True
            if command[0] == "again":
                _, version, scale = command
                for tensor in {id(t): t for t in weights.values()}.values():  # tied: once
                    tensor.mul_(scale)
                transport, mode = "cuda_ipc", "full"
            elif command[0] == "tied":
                _, address, path, version, names = command
                weights = {k: v.cuda() for k, v in _load_in_order(path).items()}
                for name in names[1:]:
                    weights[name] = weights[names[0]]
                flatten_weights(weights)
                transport, mode = "cuda_ipc", "full"
                connected(address)
            else:
                _, address, path, version, transport, flat, mode, *packed = command
                pack = bool(packed)
                weights = {k: v.cuda() for k, v in _load_in_order(path).items()}
                if flat:
                    flatten_weights(weights)
                connected(address)
            assert client is not None
            storages = len({t.untyped_storage().data_ptr() for t in weights.values()})
            result = client.update_weights(
                weights, version=version, transport=transport, mode=mode, pack=pack
            )
            results.put((result.transport, result.version, storages))
        except Exception as error:  # the test reads it
            results.put(f"{type(error).__name__}: {error}")


@pytest.fixture(scope="module")
def cuda_server(actor_dir: Path) -> Iterator[RolloutServer]:
    # The hf generation path: no engine compile to wait for (these tests are about weights).
    config = _config(device="cuda", dtype="bfloat16", actor=str(actor_dir), generation_path="hf")
    with RolloutServer(config, models=load_models(config)) as server:
        yield server


@pytest.fixture(scope="module")
def trainer() -> Iterator[tuple[multiprocessing.Queue, multiprocessing.Queue]]:
    context = multiprocessing.get_context("spawn")
    commands, results = context.Queue(), context.Queue()
    process = context.Process(target=_trainer, args=(commands, results), daemon=True)
    process.start()
    try:
        yield commands, results
    finally:
        commands.put(None)
        process.join(timeout=WAIT_S)
        if process.is_alive():
            process.kill()


def _weights_file(server: RolloutServer, folder: Path, version: int) -> tuple[str, dict]:
    """The trainer's weights for `version` (bf16, what the server must hold bit for bit), with
    the order of the model's state dict (a safetensors file sorts its tensors by name)."""
    from safetensors.torch import save_file

    weights = _bf16_weights(server.state.models.actor.module, version)
    path = str(folder / f"v{version}.safetensors")
    save_file(weights, path, metadata={"order": ",".join(weights)})
    return path, weights


def _load_in_order(path: str) -> dict[str, torch.Tensor]:
    """A file of `_weights_file` (or any safetensors file) as a state dict in the model's order
    (what a trainer's model.state_dict() gives: the order the update file follows)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    loaded = load_file(path)
    with safe_open(path, "pt") as opened:
        order = (opened.metadata() or {}).get("order")
    return loaded if order is None else {name: loaded[name] for name in order.split(",")}


def _bf16_weights(actor: torch.nn.Module, version: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(version)
    return {name: (t.detach().float().cpu() + 0.05 * torch.randn(t.shape, generator=generator))
            .to(torch.bfloat16).contiguous()
            for name, t in actor.state_dict().items()}  # fmt: skip


def _assert_serves(server: RolloutServer, weights: dict[str, torch.Tensor]) -> None:
    served = server.state.models.actor.module.state_dict()
    for name, tensor in weights.items():
        assert torch.equal(served[name].cpu(), tensor), name


@pytest.fixture
def cpu_stands_in_for_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    stand_in_for_cuda(monkeypatch)


def _exported(weights: dict[str, torch.Tensor]) -> tuple[object, int, int]:
    """The export of `weights` as one update; where its data section begins, and its size."""
    from rollserve.client.weights.cuda_ipc import CudaIpcExports, export_cuda_ipc

    update = prepare_update(weights, version=1)
    head, specs = update.layout()
    return export_cuda_ipc(update, CudaIpcExports()), len(head), specs[-1].end


def test_the_export_describes_each_storage_once_and_merges_what_continues(
    cpu_stands_in_for_cuda: None,
) -> None:
    from rollserve.client.weights.flat_weights import flatten_weights

    model = perturbed(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)), 1)
    flat = {name: tensor.clone() for name, tensor in model.items()}
    flatten_weights(flat)
    export, data_start, data_bytes = _exported(flat)
    source = export.source
    assert len(source.buffers) == 1 and len(source.spans) == 1  # one buffer, one span
    span = source.spans[0]
    assert (span.begin, span.end, span.buffer, span.offset) == (
        data_start, data_start + data_bytes, 0, 0,
    )  # fmt: skip
    assert len(export.keep_alive) == 1 and not export.copied  # the buffer's storage, held
    # A tensor each: a buffer and a span each, in file order.
    apart = {name: tensor.clone() for name, tensor in model.items()}
    export, data_start, _ = _exported(apart)
    assert len(export.source.buffers) == len(export.source.spans) == len(apart) == 4
    assert [s.buffer for s in export.source.spans] == [0, 1, 2, 3]
    assert export.source.spans[0].begin == data_start
    spans = list(export.source.spans)
    assert all(a.end == b.begin for a, b in zip(spans, spans[1:], strict=False))
    # One storage under two names (a tied weight) and views of one storage: described once;
    # a strided view is sent as a contiguous copy, which the export holds.
    shared = torch.randn(16, 8)
    tied = {"a.weight": shared, "b.weight": shared, "c.weight": shared.t(), "d.bias": shared[0]}
    export, _, _ = _exported(tied)
    assert export.copied == ["c.weight"]
    assert len(export.source.buffers) == 2  # the shared storage, the copy's
    assert sum(isinstance(kept, torch.Tensor) for kept in export.keep_alive) == 1
    assert sum(isinstance(kept, torch.UntypedStorage) for kept in export.keep_alive) == 2


def test_a_tied_weight_flattened_is_one_span_with_its_shadow_refreshed(
    cpu_stands_in_for_cuda: None,
) -> None:
    """A trainer's tied weight (one tensor under two names) flattened: the export copies the
    tensor's bytes into its other name's shadow, so the data section is one span (what a
    server stages in place), holding the values of now."""
    from rollserve.client.weights.flat_weights import flatten_weights

    embedding = torch.nn.Embedding(16, 8)
    model = torch.nn.ModuleDict({"embed": embedding, "head": torch.nn.Linear(8, 16, bias=False)})
    model["head"].weight = embedding.weight  # tied
    flatten_weights(model)
    weights = model.state_dict(keep_vars=True)
    with torch.no_grad():
        embedding.weight.mul_(3.0)  # an optimizer step: the shadow is stale until the export
    export, data_start, data_bytes = _exported(weights)
    assert len(export.source.buffers) == 1 and len(export.source.spans) == 1
    span = export.source.spans[0]
    assert (span.begin, span.end, span.offset) == (data_start, data_start + data_bytes, 0)
    storage = embedding.weight.untyped_storage()
    section = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (data_bytes,))
    _, specs = prepare_update(weights, version=1).layout()
    for spec in specs:  # the buffer is the data section of now, byte for byte
        want = weights[spec.name].detach().reshape(-1).view(torch.uint8)
        assert torch.equal(section[spec.begin : spec.end], want), spec.name


def test_runs_merge_only_where_they_continue_in_the_file_and_in_one_buffer() -> None:
    from rollserve.client.weights.cuda_ipc import Run, merged_runs

    # A flat buffer: every tensor right after the previous one, in file and in memory.
    assert merged_runs([Run(64, 80, 0, 0), Run(80, 96, 0, 16), Run(96, 100, 0, 32)]) == [
        Run(64, 100, 0, 0)
    ]
    kept = [
        Run(64, 80, 0, 0),
        Run(80, 96, 1, 16),  # another buffer
        Run(96, 100, 1, 48),  # a gap in memory
        Run(100, 104, 1, 48 + 4),  # ... continued: merges with the previous one
        Run(108, 112, 1, 56),  # a gap in the file (not produced by export, still kept apart)
    ]
    assert merged_runs(kept) == [kept[0], kept[1], Run(96, 104, 1, 48), kept[4]]
    assert merged_runs([]) == []


def _update_line(caplog: pytest.LogCaptureFixture, version: int) -> str:
    """The server's log line of the update to `version` (weights/update.py)."""
    lines = [
        r.getMessage() for r in caplog.records if f" to version {version} over " in r.getMessage()
    ]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.gpu
def test_a_trainer_process_updates_a_cuda_server_device_to_device(
    cuda_server: RolloutServer, trainer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    commands, results = trainer
    actor = cuda_server.state.models.actor.module
    with RolloutClient(cuda_server.address, timeout_s=WAIT_S) as client:
        assert "cuda_ipc" in client.health().weight_transports
    # Loaded into one buffer in the update file's order (models/memory.py).
    assert len({p.untyped_storage().data_ptr() for p in actor.state_dict().values()}) == 1
    pointers = {name: p.data_ptr() for name, p in actor.state_dict().items()}
    caplog.set_level(logging.INFO, logger="rollserve.server.weights.update")
    for version, transport, flat in ((1, "cuda_ipc", False), (2, "auto", False),
                                     (3, "cuda_ipc", True)):  # fmt: skip
        path, weights = _weights_file(cuda_server, tmp_path, version)
        commands.put(("update", cuda_server.address, path, version, transport, flat, "full"))
        answer = results.get(timeout=120)
        assert not isinstance(answer, str), answer
        sent_as, served_version, storages = answer
        assert (sent_as, served_version) == ("cuda_ipc", version)
        # A flat buffer (one span on the server's GPU) is staged in place (cuda_ipc.py):
        # checked and applied from the trainer's memory, no staging copy; per-tensor buffers
        # are copied into the device arena.
        line = _update_line(caplog, version)
        assert ("staged in place" in line) == flat, line
        assert ("arena_take" in line) != flat, line
        if flat:
            assert storages == 1  # one buffer, one handle
            # ... laid out like the server's parameters: the apply is one copy of it all.
            assert re.search(r"apply_launch [0-9.]+/1\b", line), line
        _assert_serves(cuda_server, weights)
        # Copied into the parameters' own storages: the engine's CUDA graphs still read them.
        assert {name: p.data_ptr() for name, p in actor.state_dict().items()} == pointers
    # The same (flat) storage after an in-place step: its description is resent, without the
    # ref counter the first update gave back; the server reads the new values.
    commands.put(("again", 4, 0.5))
    answer = results.get(timeout=120)
    assert not isinstance(answer, str) and answer == ("cuda_ipc", 4, 1), answer
    # ... and the server still has it open from version 3: nothing is opened or closed.
    line = _update_line(caplog, 4)
    assert "ipc_handle_kept 0.0000/1" in line and "ipc_handle_open" not in line, line
    assert "ipc_handle_close" not in line, line
    weights = {name: tensor * 0.5 for name, tensor in weights.items()}  # exact in bfloat16
    _assert_serves(cuda_server, weights)
    # A stale version is refused (the handles' counters are given back), the weights stay.
    before = state_hash(actor)
    commands.put(("update", cuda_server.address, path, 4, "cuda_ipc", False, "full"))
    answer = results.get(timeout=120)
    assert isinstance(answer, str) and "not above" in answer, answer
    assert state_hash(actor) == before
    # A partial update: one tensor, the rest keep their values.
    name = "model.norm.weight"
    one = {name: _bf16_weights(actor, 5)[name]}
    from safetensors.torch import save_file

    save_file(one, str(tmp_path / "partial.safetensors"))
    commands.put(("update", cuda_server.address, str(tmp_path / "partial.safetensors"), 5,
                  "cuda_ipc", False, "partial"))  # fmt: skip
    answer = results.get(timeout=120)
    assert not isinstance(answer, str) and answer[:2] == ("cuda_ipc", 5), answer
    _assert_serves(cuda_server, {**weights, **one})
    # pack=True: the trainer's own (per-storage) tensors copied into one buffer of its client,
    # so one handle, staged in place by the server.
    path, weights = _weights_file(cuda_server, tmp_path, 6)
    commands.put(("update", cuda_server.address, path, 6, "cuda_ipc", False, "full", "pack"))
    answer = results.get(timeout=120)
    assert not isinstance(answer, str) and answer[:2] == ("cuda_ipc", 6), answer
    assert answer[2] > 1  # the trainer's tensors are many storages
    assert "staged in place" in _update_line(caplog, 6)
    _assert_serves(cuda_server, weights)


EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


@pytest.fixture(scope="module")
def tied_actor_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with its lm_head tied to its embedding (as Qwen2-0.5B's)."""
    from transformers import AutoConfig, LlamaForCausalLM

    directory = save_tiny_causal_lm(tmp_path_factory.mktemp("cuda-ipc-tied"), SPEC)
    config = AutoConfig.from_pretrained(directory)
    config.tie_word_embeddings = True
    torch.manual_seed(1)
    LlamaForCausalLM(config).save_pretrained(directory)
    return directory


@pytest.mark.gpu
def test_a_tied_model_flattened_by_its_trainer_is_applied_in_place_shadow_and_all(
    tied_actor_dir: Path, trainer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The trainer's tied weight lives once in its flat buffer, its second name's bytes a
    shadow that the export refreshes (flat_weights.py): one span, staged in place; the server
    holds the tied weight once too (models/memory.py), so the apply is the run of the other
    tensors plus the tied one's copy, and both names serve the trainer's values of now."""
    from safetensors.torch import save_file

    commands, results = trainer
    config = _config(
        device="cuda", dtype="bfloat16", actor=str(tied_actor_dir), generation_path="hf"
    )
    caplog.set_level(logging.INFO, logger="rollserve.server.weights.update")
    with RolloutServer(config, models=load_models(config)) as server:
        actor = server.state.models.actor.module
        assert actor.state_dict(keep_vars=True)[HEAD] is actor.state_dict(keep_vars=True)[EMBED]
        pointers = {name: p.data_ptr() for name, p in actor.state_dict().items()}
        weights = _bf16_weights(actor, 1)
        weights[HEAD] = weights[EMBED].clone()  # a file holds the tied tensor under each name
        path = str(tmp_path / "tied.safetensors")
        save_file(weights, path, metadata={"order": ",".join(weights)})
        commands.put(("tied", server.address, path, 1, [EMBED, HEAD]))
        answer = results.get(timeout=120)
        assert not isinstance(answer, str) and answer == ("cuda_ipc", 1, 1), answer
        line = _update_line(caplog, 1)
        assert "staged in place" in line, line
        # The tied weight is written once (the last of its names), the rest as one run.
        assert re.search(r"apply_launch [0-9.]+/2\b", line), line
        _assert_serves(server, weights)
        state = actor.state_dict(keep_vars=True)
        assert state[HEAD] is state[EMBED]
        assert {name: p.data_ptr() for name, p in actor.state_dict().items()} == pointers
        # An optimizer step on the trainer's tied weight: the shadow is stale until the export
        # refreshes it; a server that got the stale bytes under lm_head would serve them.
        commands.put(("again", 2, 0.5))
        answer = results.get(timeout=120)
        assert not isinstance(answer, str) and answer == ("cuda_ipc", 2, 1), answer
        assert "staged in place" in _update_line(caplog, 2)
        _assert_serves(server, {name: tensor * 0.5 for name, tensor in weights.items()})


@pytest.mark.gpu
def test_handles_of_a_trainer_that_exited_are_refused_and_the_old_weights_serve(
    cuda_server: RolloutServer, tmp_path: Path
) -> None:
    actor = cuda_server.state.models.actor.module
    before = state_hash(actor)
    with RolloutClient(cuda_server.address, timeout_s=WAIT_S) as client:
        version = client.health().policy_version
    path, _ = _weights_file(cuda_server, tmp_path, 50)
    context = multiprocessing.get_context("spawn")
    commands, results = context.Queue(), context.Queue()
    process = context.Process(target=_trainer, args=(commands, results), daemon=True)
    process.start()
    commands.put(("export", path, version + 1))
    messages = results.get(timeout=120)
    process.join(timeout=WAIT_S)
    assert not isinstance(messages, str), messages
    assert process.exitcode == 0
    with grpc.insecure_channel(cuda_server.address) as channel:
        with pytest.raises(grpc.RpcError) as caught:
            update_weights_callable(channel)(iter(messages), timeout=WAIT_S)
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION, caught.value.details()
    assert caught.value.details().startswith("cuda_ipc: ")
    assert state_hash(actor) == before
    with RolloutClient(cuda_server.address, timeout_s=WAIT_S) as client:
        assert client.health().policy_version == version


@pytest.mark.gpu
def test_spans_that_miss_the_data_section_are_refused_on_a_cuda_server(
    cuda_server: RolloutServer,
) -> None:
    """Checked once the head arrived, before any handle opens (these name nothing)."""
    actor = cuda_server.state.models.actor.module
    before = state_hash(actor)
    with RolloutClient(cuda_server.address, timeout_s=WAIT_S) as client:
        version = client.health().policy_version
    update = prepare_update(_bf16_weights(actor, 60), version=version + 1)
    data_start = len(update.layout()[0])
    source = pb.CudaIpcSource(host_id=cuda_ipc_host_id())
    source.buffers.append(_buffer(update.total_bytes))
    source.spans.add(begin=data_start - 8, end=update.total_bytes, buffer=0, offset=0)
    error = _refused(cuda_server, update, source)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert "data section begins" in error.details()
    assert state_hash(actor) == before


def _storage(nbytes: int = 16) -> torch.UntypedStorage:
    return torch.empty(nbytes, dtype=torch.uint8).untyped_storage()


ACTOR, CRITIC = pb.MODEL_ROLE_ACTOR, pb.MODEL_ROLE_CRITIC


def test_kept_buffers_are_found_by_role_and_key_and_go_when_no_kept_update_names_them() -> None:
    kept = KeptIpcBuffers(keep_s=60.0)
    try:
        first, second, critics = _storage(), _storage(), _storage()
        key = (0, b"handle", 0, 16)
        kept.keep(ACTOR, {key: (first, {}), (0, b"handle", 16, 16): (second, {})})
        kept.keep(CRITIC, {key: (critics, {"last": "views"})})
        assert kept.take(ACTOR, key) is first and kept.take(CRITIC, key) is critics
        assert (
            kept.views(CRITIC, key) == {"last": "views"}
            and kept.views(ACTOR, (9, b"", 0, 1)) is None
        )
        assert kept.take(ACTOR, (0, b"handle", 0, 32)) is None  # another size: another storage
        assert kept.take(ACTOR, (1, b"handle", 0, 16)) is None  # another device
        assert len(kept) == 3
        # The actor's next updates name only `first`: `second`, named by the last KEPT_UPDATES
        # updates no more, is let go (closed once unused); until then it stays.
        assert KEPT_UPDATES == 2
        dropped = StorageWeakRef(second)
        kept.keep(ACTOR, {key: (first, {})})
        assert kept.take(ACTOR, (0, b"handle", 16, 16)) is second and len(kept) == 3
        kept.keep(ACTOR, {key: (first, {})})
        del second
        assert dropped.expired() and kept.take(ACTOR, key) is first and len(kept) == 2
        # A trainer alternating two buffers: both stay open.
        other, other_key = _storage(), (0, b"other", 0, 16)
        for _ in range(3):
            kept.keep(ACTOR, {other_key: (other, {})})
            kept.keep(ACTOR, {key: (first, {})})
        assert kept.take(ACTOR, other_key) is other and kept.take(ACTOR, key) is first
        assert len(kept) == 3
        # A storage in use by an update in flight stays open whatever is released meanwhile.
        in_use = kept.take(CRITIC, key)
        kept.release()
        assert len(kept) == 0 and kept.take(CRITIC, key) is None
        assert in_use is critics and not StorageWeakRef(in_use).expired()
    finally:
        kept.release()


def test_only_buffers_of_cudamalloc_memory_without_an_event_are_kept() -> None:
    """torch's handle of an expandable segment (type 'e': file descriptors, whose numbers may
    come back the same for new pages) must not find a kept mapping of the old pages."""
    malloc = CUDA_MALLOC_HANDLE + b"\x07" * 64
    assert keepable(pb.CudaIpcBuffer(handle=malloc))
    assert not keepable(pb.CudaIpcBuffer(handle=b"\x02e" + b"\x07" * 64))
    assert not keepable(pb.CudaIpcBuffer(handle=malloc, event_sync_required=True))
    assert not keepable(pb.CudaIpcBuffer(handle=b"\x03c" + b"\x07" * 64))  # another version


@pytest.mark.gpu
def test_torch_hands_out_cudamalloc_handles_that_are_kept() -> None:
    """The handle format keepable reads (CUDACachingAllocator's shareIpcHandle) is this
    torch's: a plain allocation's storage is described as cudaMalloc memory."""
    import os

    settings = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + os.environ.get(
        "PYTORCH_ALLOC_CONF", ""
    )
    if "expandable_segments:true" in settings.replace(" ", "").lower():
        pytest.skip("this process's allocator uses expandable segments (their handles: type 'e')")
    storage = torch.zeros(1 << 20, device="cuda").untyped_storage()
    handle = storage._share_cuda_()[1]
    assert handle[:2] == CUDA_MALLOC_HANDLE, handle[:2]


def test_kept_buffers_go_after_keep_s_without_an_update() -> None:
    kept = KeptIpcBuffers(keep_s=3600.0)
    storage = _storage()
    gone = StorageWeakRef(storage)
    kept.keep(ACTOR, {(0, b"h", 0, 16): (storage, {})})
    del storage
    kept._expire()  # the timer firing early (as after a newer update): it waits the rest
    assert len(kept) == 1 and kept._timer is not None
    kept.release()
    assert gone.expired() and kept._timer is None
    # The timer itself, with no time to keep: released by its own thread.
    quick = KeptIpcBuffers(keep_s=0.0)
    quick.keep(ACTOR, {(0, b"h", 0, 16): (_storage(), {})})
    timer = quick._timer
    assert timer is not None
    timer.join(WAIT_S)
    assert len(quick) == 0


def test_a_server_keeps_buffers_unless_switched_off_and_releases_them_at_stop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert keeps_buffers()
    planes = Planes("grpc,shm", torch.device("cpu"))
    assert planes.kept_ipc is not None
    storage = _storage()
    planes.kept_ipc.keep(ACTOR, {(0, b"h", 0, 16): (storage, {})})
    gone = StorageWeakRef(storage)
    del storage
    planes.close()
    assert gone.expired()
    monkeypatch.setenv("ROLLSERVE_CUDA_IPC_KEEP", "0")
    assert not keeps_buffers() and Planes("grpc", torch.device("cpu")).kept_ipc is None
