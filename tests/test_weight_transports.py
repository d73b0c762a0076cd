"""Every UpdateWeights data plane keeps every guarantee of the gRPC stream.

Transports: one gRPC stream, parallel gRPC streams (separate connections), shared memory (a
sealed memfd on the same host), and a torch.distributed (gloo) broadcast through a WeightsGroup.
For each: the server's weights become the trainer's bit for bit and its log-probs the trainer's;
versions are checked; bad values, wrong shapes and stale versions leave the old weights serving;
LoRA adapters are idempotent; a --wait-for-weights server serves after the first update. Then the
bad input of each data plane (a missing, short, unsealed or changed segment; a part cut, doubled
or missing; an unknown group, a stale vote), each against a real server.
"""

from __future__ import annotations

import copy
import fcntl
import mmap
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
import torch
from helpers_weights import perturbed, state_hash
from rollserve.client import RolloutClient
from rollserve.client.protocol.errors import (
    FailedPrecondition,
    InvalidArgument,
)
from rollserve.client.protocol.wire import update_weights_callable
from rollserve.client.weights.distributed import WeightsGroup
from rollserve.client.weights.shared_memory import SharedMemoryFile
from rollserve.client.weights.update_file import iter_safetensors_bytes, prepare_update
from rollserve.server.config import ServerConfig
from rollserve.server.experience.scoring import action_log_probs
from rollserve.server.models import ModelSet, load_models
from rollserve.server.models.default_model import TinyModelSpec, save_tiny_causal_lm
from rollserve.server.serving.app import RolloutServer
from rollserve.server.weights import staging_arena
from rollserve.v1 import rollout_pb2 as pb

KIB = 1024
SPEC = TinyModelSpec(hidden_size=128, intermediate_size=1024)  # MLP weights: 512 KiB each
PROMPTS = [[1, 72, 101, 108, 108], [1, 50, 51]]
EXPERIENCE = dict(max_new_tokens=6, temperature=1.0, seed=3, rewards=["exact_match"],
                  gt_answers=["a", "b"], algorithm={"whitening": "none"})  # fmt: skip
WAIT_S = 30.0
# "dist-flat": a WeightsGroup of 3 lanes broadcasting weights flattened into one run (contiguous
# spans); "dist": 2 lanes (the default), ranges that follow the tensors.
TRANSPORTS = ["grpc", "grpc-parallel", "shm", "dist", "dist-flat"]
LORA_MODULE = "model.layers.0.self_attn.q_proj"

Send = Callable[..., object]


@pytest.fixture(scope="module")
def actor_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_causal_lm(tmp_path_factory.mktemp("transport-actor"), SPEC)


@pytest.fixture(scope="module")
def models(actor_dir: Path) -> ModelSet:
    return load_models(ServerConfig(device="cpu", actor=str(actor_dir)))


def _config(**overrides: object) -> ServerConfig:
    return ServerConfig(**{"host": "127.0.0.1", "port": 0, "device": "cpu", "metrics_port": 0,
                           **overrides})  # fmt: skip


@pytest.fixture
def server(models: ModelSet) -> Iterator[RolloutServer]:
    with RolloutServer(_config(), models=models) as running:
        yield running


@pytest.fixture
def client(server: RolloutServer) -> Iterator[RolloutClient]:
    with RolloutClient(server.address, timeout_s=WAIT_S) as rollout:
        yield rollout


@contextmanager
def sender(client: RolloutClient, transport: str) -> Iterator[Send]:
    """client.update_weights bound to one transport (a WeightsGroup for "dist", "dist-flat")."""
    if transport in ("dist", "dist-flat"):
        flat = transport == "dist-flat"
        lanes = 3 if flat else None
        with WeightsGroup([client], timeout_s=WAIT_S, bucket_bytes=256 * KIB, lanes=lanes) as group:

            def send(weights: dict[str, torch.Tensor], **options: object) -> object:
                if flat:
                    group.flatten_weights(weights)
                return client.update_weights(weights, transport="dist", group=group, **options)

            yield send
        return
    if transport == "grpc-parallel":
        yield lambda weights, **options: client.update_weights(
            weights, transport="grpc", streams=3, chunk_bytes=256 * KIB, **options
        )
        return
    if transport == "grpc":  # one stream, whatever the core count would pick
        yield lambda weights, **options: client.update_weights(
            weights, transport="grpc", streams=1, **options
        )
        return
    yield lambda weights, **options: client.update_weights(weights, transport=transport, **options)


def loaded(module: torch.nn.Module, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    shadow = copy.deepcopy(module)
    shadow.load_state_dict(weights)
    return shadow


def assert_logprobs_match(experience, module: torch.nn.Module) -> None:
    expected, _ = action_log_probs(module, experience.sequences, experience.attention_mask,
                                   experience.num_actions, forward_batch_size=64)  # fmt: skip
    mask = experience.action_mask
    torch.testing.assert_close(experience.action_log_probs[mask], expected[mask])


# ---- the guarantees, for every transport --------------------------------------------------------


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_an_update_lands_bit_exact_versioned_and_scores_like_the_trainer(
    models: ModelSet, client: RolloutClient, transport: str
) -> None:
    actor = models.actor.module
    with sender(client, transport) as send:
        for version in (1, 2):
            weights = perturbed(actor, seed=version)
            trainer = loaded(actor, weights)
            progress: list[tuple[int, int]] = []
            result = send(
                weights, version=version, progress=lambda *p, seen=progress: seen.append(p)
            )
            assert (result.version, result.tensors) == (version, len(weights))
            assert state_hash(actor) == state_hash(trainer)
            assert progress[-1] == (result.bytes, result.bytes)
    assert result.transport == transport.removesuffix("-flat")
    experience = client.make_experience(PROMPTS, **EXPERIENCE)
    assert experience.policy_version.tolist() == [2, 2]
    assert_logprobs_match(experience, trainer)
    assert client.health().policy_version == 2


def _nan_in_last_tensor(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    weights = perturbed(module, seed=9)
    last = list(weights)[-1]
    weights[last] = weights[last].clone()
    weights[last].view(-1)[-1] = float("nan")
    return weights


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_bad_updates_leave_the_old_weights_serving(
    models: ModelSet, client: RolloutClient, transport: str
) -> None:
    actor = models.actor.module
    before = state_hash(actor)
    wrong_shape = {"model.norm.weight": torch.ones(3)}
    with sender(client, transport) as send:
        with pytest.raises(InvalidArgument, match="NaN"):
            send(_nan_in_last_tensor(actor), version=1)
        with pytest.raises(InvalidArgument, match="shape"):
            send(wrong_shape, version=1, mode="partial")
        assert state_hash(actor) == before and client.health().policy_version == 0
        send(perturbed(actor, seed=4), version=5)
        after = state_hash(actor)
        with pytest.raises(FailedPrecondition, match="not above"):
            send(perturbed(actor, seed=5), version=5)
        # The staging memory is the one reused arena: no second buffer was kept.
        assert staging_arena(actor).capacity_bytes < 2 * sum(
            t.nbytes for t in actor.state_dict().values()
        )
        # sha256 end to end (for shm and the parallel parts it covers the server's own copy).
        send(perturbed(actor, seed=6), version=6, sha256=True)
    assert state_hash(actor) != after and client.health().policy_version == 6


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_lora_adapter_is_idempotent(
    models: ModelSet, client: RolloutClient, transport: str
) -> None:
    actor = models.actor.module
    base = actor.state_dict()[f"{LORA_MODULE}.weight"].clone()
    out_features, in_features = base.shape
    generator = torch.Generator().manual_seed(12)
    a = torch.randn(4, in_features, generator=generator)
    b = torch.randn(out_features, 4, generator=generator)
    adapter = {f"base_model.model.{LORA_MODULE}.lora_A.weight": a,
               f"base_model.model.{LORA_MODULE}.lora_B.weight": b}  # fmt: skip
    lora = pb.LoraAdapter(rank=4, alpha=8.0)
    with sender(client, transport) as send:
        send(adapter, version=1, mode="lora", lora=lora)
        once = state_hash(actor)
        send(adapter, version=2, mode="lora", lora=lora)
    assert state_hash(actor) == once
    torch.testing.assert_close(actor.state_dict()[f"{LORA_MODULE}.weight"], base + 2.0 * (b @ a))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_wait_for_weights_serves_after_the_first_update(actor_dir: Path, transport: str) -> None:
    models = load_models(ServerConfig(device="cpu", actor=str(actor_dir)))
    with RolloutServer(_config(wait_for_weights=True), models=models) as server:
        with RolloutClient(server.address, timeout_s=WAIT_S) as client:
            assert client.health().status == "WAITING_FOR_WEIGHTS"
            with pytest.raises(FailedPrecondition, match="waiting for its first weights"):
                client.make_experience(PROMPTS, **EXPERIENCE)
            with sender(client, transport) as send:
                send(perturbed(models.actor.module, seed=8), version=1)
            assert client.health().status == "SERVING"
            assert client.make_experience(PROMPTS, **EXPERIENCE).policy_version.tolist() == [1, 1]


# ---- transport "auto" and explicit transports that cannot work --------------------------------


def test_auto_uses_shared_memory_on_the_same_host(
    models: ModelSet, client: RolloutClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = client.update_weights(perturbed(models.actor.module, seed=1), version=1)
    assert result.transport == "shm"
    # A per-chunk CRC is a stream feature: auto sends such an update over gRPC, on one stream
    # per 4 cores (default_streams), so the same call is parallel on a bigger machine.
    for version, cores, expected in ((2, 2, "grpc"), (3, 16, "grpc-parallel")):
        monkeypatch.setattr(os, "cpu_count", lambda cores=cores: cores)
        weights = perturbed(models.actor.module, seed=version)
        result = client.update_weights(weights, version=version, crc32=True)
        assert (result.version, result.transport) == (version, expected)


def test_unknown_transports_and_a_dist_without_group_are_refused(client: RolloutClient) -> None:
    weights = {"model.norm.weight": torch.ones(SPEC.hidden_size)}
    with pytest.raises(InvalidArgument, match="transport"):
        client.update_weights(weights, version=1, mode="partial", transport="carrier-pigeon")
    with pytest.raises(InvalidArgument, match="group"):
        client.update_weights(weights, version=1, mode="partial", transport="dist")
    with pytest.raises(InvalidArgument, match="streams"):
        client.update_weights(weights, version=1, mode="partial", transport="grpc", streams=0)


# ---- shared memory: bad references ------------------------------------------------------------


def _raw_update(
    server: RolloutServer, header: pb.WeightsHeader, chunks: list[bytes] = ()
) -> pb.UpdateWeightsResponse:
    channel = grpc.insecure_channel(server.address)
    try:
        call = update_weights_callable(channel)
        messages = [pb.UpdateWeightsRequest(header=header).SerializeToString(), *chunks]
        return call(iter(messages), timeout=WAIT_S)
    finally:
        channel.close()


def _file_bytes(
    weights: dict[str, torch.Tensor], version: int, **options: object
) -> tuple[pb.WeightsHeader, bytes]:
    """A partial update's header and its whole safetensors file."""
    update = prepare_update(weights, target="actor", version=version, mode="partial", **options)
    return update.header, b"".join(iter_safetensors_bytes(weights, 1 << 20))


def _memfd(data: bytes, *, size: int | None = None, seals: int | None = None) -> int:
    fd = os.memfd_create("test-weights", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, len(data) if size is None else size)
    os.pwrite(fd, data[: size if size is not None else len(data)], 0)
    if seals is not None:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def _shm_header(header: pb.WeightsHeader, fd: int, pid: int | None = None) -> pb.WeightsHeader:
    header = copy.deepcopy(header)
    header.shared_memory.pid = os.getpid() if pid is None else pid
    header.shared_memory.fd = fd
    return header


def _expect(code: grpc.StatusCode, match: str, call: Callable[[], object]) -> None:
    with pytest.raises(grpc.RpcError) as raised:
        call()
    assert raised.value.code() == code, raised.value.details()
    assert match in raised.value.details(), raised.value.details()


def test_bad_shared_memory_references_are_refused(models: ModelSet, server: RolloutServer) -> None:
    actor = models.actor.module
    before = state_hash(actor)
    weights = {"model.norm.weight": torch.full((SPEC.hidden_size,), 2.0)}
    header, data = _file_bytes(weights, version=1)
    sealed = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
    missing = _shm_header(header, fd=999_999)
    _expect(
        grpc.StatusCode.FAILED_PRECONDITION, "does not exist", lambda: _raw_update(server, missing)
    )
    no_process = _shm_header(header, fd=0, pid=2**22 + 12345)
    _expect(
        grpc.StatusCode.FAILED_PRECONDITION,
        "does not exist",
        lambda: _raw_update(server, no_process),
    )
    fds = []
    try:
        fds.append(unsealed := _memfd(data))
        _expect(
            grpc.StatusCode.INVALID_ARGUMENT,
            "sealed",
            lambda: _raw_update(server, _shm_header(header, unsealed)),
        )
        fds.append(short := _memfd(data, size=len(data) - 8, seals=sealed))
        _expect(
            grpc.StatusCode.INVALID_ARGUMENT,
            "fewer than",
            lambda: _raw_update(server, _shm_header(header, short)),
        )
        # Changed after the trainer hashed it: sha256 catches it on the server's own copy.
        hashed, _ = _file_bytes(weights, version=1, sha256=True)
        changed = bytearray(data)
        changed[-1] ^= 0x01
        fds.append(tampered := _memfd(bytes(changed), seals=sealed))
        _expect(
            grpc.StatusCode.INVALID_ARGUMENT,
            "sha256",
            lambda: _raw_update(server, _shm_header(hashed, tampered)),
        )
        # Chunks after a shared-memory header are refused too.
        fds.append(good := _memfd(data, seals=sealed))
        _expect(grpc.StatusCode.INVALID_ARGUMENT, "no chunks",
                lambda: _raw_update(server, _shm_header(header, good), [b"\x12\x00"]))  # fmt: skip
        assert state_hash(actor) == before
        assert _raw_update(server, _shm_header(header, good)).version == 1
        assert torch.equal(actor.state_dict()["model.norm.weight"], weights["model.norm.weight"])
    finally:
        for fd in fds:
            os.close(fd)


def _written(count: int) -> bytes:
    written = pb.SharedMemoryWritten(bytes=count)
    return pb.UpdateWeightsRequest(shm_written=written).SerializeToString()


def test_a_streamed_shared_memory_file_must_be_written_in_full_and_in_order(
    models: ModelSet, server: RolloutServer
) -> None:
    """shared_memory.streamed: the server copies what SharedMemoryWritten says is written;
    a count that goes back or past the file, a stream that ends early, or a chunk is refused."""
    actor = models.actor.module
    before = state_hash(actor)
    weights = {"model.norm.weight": torch.full((SPEC.hidden_size,), 3.0)}
    header, data = _file_bytes(weights, version=1)
    fd = _memfd(data, seals=fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    streamed = _shm_header(header, fd)
    streamed.shared_memory.streamed = True
    total = len(data)
    try:
        refusals = {
            "ended when 100 of": [_written(100)],
            "must not decrease": [_written(100), _written(50)],
            "nor pass header.total_bytes": [_written(total + 1)],
            "no chunk": [_written(100), b"\x12\x00"],
            "ended when 0 of": [],
        }
        for match, messages in refusals.items():
            _expect(grpc.StatusCode.INVALID_ARGUMENT, match,
                    lambda m=messages: _raw_update(server, streamed, m))  # fmt: skip
        # A count on an update whose bytes come as chunks is refused too.
        _expect(grpc.StatusCode.INVALID_ARGUMENT, "shm_written belongs",
                lambda: _raw_update(server, header, [_written(10)]))  # fmt: skip
        assert state_hash(actor) == before
        steps = [_written(n) for n in (8, 9, total // 2, total // 2, total)]
        assert _raw_update(server, streamed, steps).version == 1
        assert torch.equal(actor.state_dict()["model.norm.weight"], weights["model.norm.weight"])
    finally:
        os.close(fd)


def test_a_segment_written_while_the_server_copies_never_serves_unverified_values(
    models: ModelSet, server: RolloutServer
) -> None:
    """A writer racing the server's copy: with sha256 the update either lands whole or fails."""
    actor = models.actor.module
    weights = perturbed(actor, seed=21)
    update = prepare_update(weights, target="actor", version=1, mode="full", sha256=True)
    shm = SharedMemoryFile()
    head, specs = update.layout()
    shm.write(head, [(spec.begin, weights[spec.name]) for spec in specs])
    stop = threading.Event()
    mapping = mmap.mmap(shm.fd, shm.capacity_bytes)

    def scribble() -> None:
        position = len(head)
        while not stop.is_set():
            mapping[position : position + 4] = b"\xff\xff\xff\x7f"  # a NaN, then put it back
            mapping[position : position + 4] = bytes(
                memoryview(weights[specs[0].name].reshape(-1)[:1].numpy()).cast("B")
            )

    before = state_hash(actor)
    writer = threading.Thread(target=scribble)
    writer.start()
    try:
        try:
            _raw_update(server, _shm_header(update.header, shm.fd))
            assert state_hash(actor) == state_hash(loaded(actor, weights))
        except grpc.RpcError as error:
            # The NaN, or the sha256 of a copy taken mid-write: refused, old weights intact.
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
            assert state_hash(actor) == before
    finally:
        stop.set()
        writer.join()
        mapping.close()
        shm.close()
    for tensor in actor.state_dict().values():
        assert torch.isfinite(tensor).all()


def test_a_server_can_turn_the_other_data_planes_off(models: ModelSet) -> None:
    config = _config(weight_transports="grpc")
    weights = {"model.norm.weight": torch.full((SPEC.hidden_size,), 3.0)}
    with RolloutServer(config, models=models) as server:
        with RolloutClient(server.address, timeout_s=WAIT_S) as client:
            assert client.health().status == "SERVING"
            with pytest.raises(FailedPrecondition, match="transport 'shm'"):
                client.update_weights(weights, version=1, mode="partial", transport="shm")
            with pytest.raises(FailedPrecondition, match="does not accept dist"):
                WeightsGroup([client], timeout_s=5.0)
            result = client.update_weights(weights, version=1, mode="partial")  # auto: gRPC
            assert (result.version, result.transport) == (1, "grpc")
        header, data = _file_bytes(weights, version=2)
        fd = _memfd(data, seals=fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        try:
            _expect(grpc.StatusCode.FAILED_PRECONDITION, "does not accept",
                    lambda: _raw_update(server, _shm_header(header, fd)))  # fmt: skip
        finally:
            os.close(fd)


def test_shared_weights_are_sent_without_a_copy_and_stay_trainable(
    models: ModelSet, client: RolloutClient
) -> None:
    actor = models.actor.module
    trainer = copy.deepcopy(actor).requires_grad_(True)
    optimizer = torch.optim.SGD(trainer.parameters(), lr=0.1)
    client.share_weights(trainer)  # the parameters now live in the client's memfd
    pointers = {name: p.data_ptr() for name, p in trainer.named_parameters()}
    for version in (1, 2):
        optimizer.zero_grad()
        trainer(torch.tensor([[1, 5, 9, 13]])).logits.square().mean().backward()
        optimizer.step()  # trains in place, in shared memory
        assert {name: p.data_ptr() for name, p in trainer.named_parameters()} == pointers
        result = client.update_weights(trainer, version=version, transport="shm")
        assert (result.version, result.transport) == (version, "shm")
        assert state_hash(actor) == state_hash(trainer)


def recorded_headers(client: RolloutClient, monkeypatch: pytest.MonkeyPatch) -> list:
    """The headers of the group updates `client` starts from now on (WeightsHeader each)."""
    sent_headers: list[pb.WeightsHeader] = []
    start_small = client.weights_calls.start_small

    def recording(messages, timeout_s, request_id):  # type: ignore[no-untyped-def]
        sent_headers.append(pb.UpdateWeightsRequest.FromString(messages[0]).header)
        return start_small(messages, timeout_s, request_id)

    monkeypatch.setattr(client.weights_calls, "start_small", recording)
    return sent_headers


def test_flattened_weights_are_broadcast_in_plain_slices_over_every_lane(
    models: ModelSet, client: RolloutClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trainer that flattened its weights (WeightsGroup.flatten_weights) sends the header with
    DistributedSource.contiguous, and the server cuts the data section the same way; a
    trainer that did not sends the ranges that follow the tensors. Both land bit for bit."""
    actor = models.actor.module
    sent_headers = recorded_headers(client, monkeypatch)
    trainer = copy.deepcopy(actor).requires_grad_(True)
    with WeightsGroup([client], timeout_s=WAIT_S, bucket_bytes=64 * KIB, lanes=4) as group:
        assert group.lanes == 4
        client.update_weights(perturbed(actor, seed=1), version=1, group=group)
        group.flatten_weights(trainer)
        optimizer = torch.optim.SGD(trainer.parameters(), lr=0.1)
        for version in (2, 3):
            optimizer.zero_grad()
            trainer(torch.tensor([[1, 5, 9, 13]])).logits.square().mean().backward()
            optimizer.step()  # trains in the flat buffer
            result = client.update_weights(trainer, version=version, group=group)
            assert (result.version, result.transport) == (version, "dist")
            assert state_hash(actor) == state_hash(trainer)
    assert [h.distributed.contiguous for h in sent_headers] == [False, True, True]
    assert {h.distributed.bucket_bytes for h in sent_headers} == {64 * KIB}


def test_a_tied_weight_flattened_is_still_broadcast_in_plain_slices(
    models: ModelSet, client: RolloutClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trainer whose lm_head is tied to its embedding (one Parameter, two names): flattened,
    the second name's bytes are a shadow refreshed before each update (flat_weights.py), so
    the data section is still one run (plain slices), and the server gets the values of now
    under both names."""
    actor = models.actor.module
    sent_headers = recorded_headers(client, monkeypatch)
    trainer = copy.deepcopy(actor)
    trainer.lm_head.weight = trainer.model.embed_tokens.weight  # tied on the trainer's side
    with WeightsGroup([client], timeout_s=WAIT_S, bucket_bytes=64 * KIB) as group:
        group.flatten_weights(trainer)
        for version in (1, 2):
            with torch.no_grad():
                trainer.model.embed_tokens.weight.mul_(1.5)  # a step after flattening
            client.update_weights(trainer, version=version, group=group)
            assert state_hash(actor) == state_hash(trainer)
    assert [h.distributed.contiguous for h in sent_headers] == [True, True]


def test_weights_group_lanes_are_checked(client: RolloutClient) -> None:
    for lanes in (0, 9):
        with pytest.raises(InvalidArgument, match="lanes"):
            WeightsGroup([client], timeout_s=WAIT_S, lanes=lanes)


def test_buckets_too_small_for_the_file_are_refused_on_both_sides(
    models: ModelSet, client: RolloutClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """1-byte broadcasts of a 0.4 MB file would be 4e5 broadcasts (MAX_BROADCASTS): the trainer
    refuses before sending anything; a trainer that does not check is refused by the server
    before the vote, so nobody broadcasts, and the group stays usable."""
    from rollserve.client.weights import distributed

    actor = models.actor.module
    weights = perturbed(actor, seed=3)
    before = state_hash(actor)
    with WeightsGroup([client], timeout_s=WAIT_S, bucket_bytes=1) as group:
        with pytest.raises(InvalidArgument, match="larger buckets"):
            client.update_weights(weights, version=1, group=group)
        monkeypatch.setattr(distributed, "broadcast_spans", lambda *args, **kwargs: [])
        with pytest.raises(InvalidArgument, match="header.distributed.bucket_bytes"):
            client.update_weights(weights, version=1, group=group)
        monkeypatch.undo()
        assert state_hash(actor) == before and client.health().policy_version == 0
        group.bucket_bytes = None  # the default again: the same group still works
        assert client.update_weights(weights, version=1, group=group).version == 1
