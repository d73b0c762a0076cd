"""AsyncRolloutClient: every RPC against a real in-process server, and the transport behaviour
(metadata, retries, deadlines, cancellation, TLS) against the scripted stand-in of
tests/test_client.py.

Each test runs its own event loop (asyncio.run) and opens its client inside it, as grpc.aio
requires; the module's server keeps its policy version between tests, so tests read the
current version first.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import threading
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import test_client
import torch
from helpers_server import free_port
from rollserve.client.aio import AsyncRolloutClient
from rollserve.client.channel import SERVICE_NAME
from rollserve.client.client import RolloutClient
from rollserve.client.protocol.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    Unavailable,
)
from rollserve.client.protocol.experience import Experience, concat_experiences
from rollserve.client.weights.update_file import (
    MIN_CHUNK_BYTES,
    update_weights_messages,
)
from rollserve.server.config import ServerConfig
from rollserve.server.models import ModelSet, load_models
from rollserve.server.serving.app import RolloutServer
from rollserve.v1 import rollout_pb2 as pb
from test_client import HANG, ONE_THEN_HANG, SCRIPTED_VERSION, TOKEN, WAIT_S, Pki
from test_update_weights_rpc import assert_logprobs_match, perturbed, state_hash

# The scripted stand-in server and the TLS fixtures of tests/test_client.py.
pki = test_client.pki
scripted_server = test_client.scripted_server
scripted = test_client.scripted
tls_server = test_client.tls_server

PROMPTS = [[5, 6, 7], [40, 41, 42, 43]]
REQUEST = dict(
    samples_per_prompt=2,
    max_new_tokens=4,
    seed=3,
    rewards=["exact_match"],
    gt_answers=["a", "b"],
    algorithm={"whitening": "none"},  # micro-batches stream as they are made
    micro_batch_size=2,
)
NORM = "model.norm.weight"  # a small tensor of the tiny Llama, for partial updates


@pytest.fixture(scope="module")
def models(tiny_actor_dir) -> ModelSet:
    return load_models(ServerConfig(device="cpu", actor=str(tiny_actor_dir)))


@pytest.fixture(scope="module")
def server(models: ModelSet) -> Iterator[RolloutServer]:
    config = ServerConfig(host="127.0.0.1", port=0, device="cpu", log_level="WARNING")
    with RolloutServer(config, models=models) as running:
        yield running


def _assert_identical(a: Experience, b: Experience) -> None:
    for field in dataclasses.fields(Experience):
        x, y = getattr(a, field.name), getattr(b, field.name)
        if field.name == "info":
            assert x.keys() == y.keys()
            # Skips the wall-clock phase timings (info "time/..."): no seed repeats them.
            assert all(torch.equal(x[k], y[k]) for k in x if not k.startswith("time/"))
        elif isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), field.name
        else:
            assert x == y, field.name


# ---- a real server ----------------------------------------------------------------------------


def test_health_and_wait_until_ready(server: RolloutServer) -> None:
    async def main():
        async with AsyncRolloutClient(server.address, timeout_s=WAIT_S) as client:
            return await client.health(), await client.wait_until_ready(timeout_s=WAIT_S)

    health, ready = asyncio.run(main())
    assert health.serving and ready.serving
    assert health.vocab_size == 259 and "ACTOR" in [m.role for m in health.models]


def test_make_and_stream_experience_equal_the_sync_clients(server: RolloutServer) -> None:
    async def main():
        async with AsyncRolloutClient(server.address, timeout_s=WAIT_S) as client:
            made = await client.make_experience(PROMPTS, device="cpu", **REQUEST)
            streamed = [e async for e in client.stream_experience(PROMPTS, **REQUEST)]
            # Calls share the channel concurrently.
            together = await asyncio.gather(
                client.health(), client.make_experience(PROMPTS, **REQUEST), client.health()
            )
            return made, streamed, together

    made, streamed, together = asyncio.run(main())
    with RolloutClient(server.address, timeout_s=WAIT_S) as sync_client:
        expected = sync_client.make_experience(PROMPTS, **REQUEST)
    assert made.num_rows == 4 and made.sequences.device.type == "cpu"
    assert [e.num_rows for e in streamed] == [2, 2]
    _assert_identical(made, expected)
    _assert_identical(concat_experiences(streamed), expected)
    assert together[1].num_rows == 4


class _ThreadRecordingWeights(Mapping[str, torch.Tensor]):
    """A state dict that notes which threads read its tensors."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self._tensors = tensors
        self.reader_threads: set[int] = set()

    def __getitem__(self, name: str) -> torch.Tensor:
        self.reader_threads.add(threading.get_ident())
        return self._tensors[name]

    def __iter__(self):
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


def test_update_weights_swaps_and_builds_chunks_off_the_loop(
    server: RolloutServer, models: ModelSet
) -> None:
    new_norm = torch.linspace(0.5, 1.5, models.actor.module.state_dict()[NORM].numel())
    weights = _ThreadRecordingWeights({NORM: new_norm})
    progress: list[tuple[int, int, int]] = []  # (sent, total, calling thread)

    async def main():
        async with AsyncRolloutClient(server.address, timeout_s=WAIT_S) as client:
            version = (await client.health()).policy_version + 1
            loop_thread = threading.get_ident()
            result = await client.update_weights(
                weights,
                version=version,
                mode="partial",
                progress=lambda sent, total: progress.append((sent, total, threading.get_ident())),
            )
            health = await client.health()
            experience = await client.make_experience([[5, 6]], **{**REQUEST, "gt_answers": ["a"]})
            return version, loop_thread, result, health, experience

    version, loop_thread, result, health, experience = asyncio.run(main())
    assert (result.version, result.tensors, result.target) == (version, 1, "ACTOR")
    assert health.policy_version == version
    assert experience.policy_version.tolist() == [version, version]
    assert torch.equal(models.actor.module.state_dict()[NORM], new_norm)
    assert weights.reader_threads and loop_thread not in weights.reader_threads
    assert progress[-1] == (result.bytes, result.bytes, loop_thread) and progress[0][0] == 0
    assert {thread for _, _, thread in progress} == {loop_thread}  # reported on the loop


def test_update_weights_lands_bit_exact_and_the_logprobs_are_the_trainers(
    server: RolloutServer, models: ModelSet
) -> None:
    trainer = copy.deepcopy(models.actor.module)
    trainer.load_state_dict(perturbed(trainer, seed=11))
    prompts = [[5, 6, 7], [40, 41]]

    async def main():
        async with AsyncRolloutClient(server.address, timeout_s=WAIT_S) as client:
            version = (await client.health()).policy_version + 1
            result = await client.update_weights(
                trainer, version=version, chunk_bytes=MIN_CHUNK_BYTES, crc32=True, sha256=True
            )
            request = {**REQUEST, "gt_answers": ["a", "b"]}
            return version, result, await client.make_experience(prompts, **request)

    version, result, experience = asyncio.run(main())
    assert result.bytes > MIN_CHUNK_BYTES  # several chunks, cut across tensor boundaries
    assert (result.version, result.tensors) == (version, len(trainer.state_dict()))
    assert state_hash(models.actor.module) == state_hash(trainer)
    assert experience.policy_version.tolist() == [version] * 4
    assert_logprobs_match(experience, trainer)


class _RawUpdateWeights:
    """A stand-in server whose UpdateWeights keeps every request message as the bytes that
    arrived (no deserializer), so a test compares the wire itself."""

    def __init__(self) -> None:
        self.calls: list[list[bytes]] = []
        handler = grpc.stream_unary_rpc_method_handler(
            self._update_weights,
            request_deserializer=None,
            response_serializer=pb.UpdateWeightsResponse.SerializeToString,
        )
        self.server = grpc.server(ThreadPoolExecutor(2))
        self.server.add_generic_rpc_handlers(
            [grpc.method_handlers_generic_handler(SERVICE_NAME, {"UpdateWeights": handler})]
        )
        self.target = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def _update_weights(self, messages: Iterator[bytes], context) -> pb.UpdateWeightsResponse:
        self.calls.append(list(messages))
        return pb.UpdateWeightsResponse(version=1)


@pytest.fixture
def raw_update_weights() -> Iterator[_RawUpdateWeights]:
    stand_in = _RawUpdateWeights()
    yield stand_in
    stand_in.server.stop(0)


def test_both_clients_put_the_hand_encoded_messages_on_the_wire(raw_update_weights) -> None:
    torch.manual_seed(4)
    base = torch.randn(300, 500)  # 600,000 bytes: chunks cut across tensors
    weights = {"w": base, "t": base.T, "h": torch.randn(999).half(), "n": torch.tensor(3)}
    options = dict(version=1, chunk_bytes=MIN_CHUNK_BYTES, crc32=True, sha256=True)
    one_stream = dict(transport="grpc", streams=1)  # the messages of one stream, on any machine

    async def main():
        async with AsyncRolloutClient(raw_update_weights.target, timeout_s=WAIT_S) as client:
            return await client.update_weights(weights, **options, **one_stream)

    asyncio.run(main())
    with RolloutClient(raw_update_weights.target, timeout_s=WAIT_S) as sync_client:
        sync_client.update_weights(weights, **options, **one_stream)
    encoded = list(update_weights_messages(weights, target="actor", mode="full", **options))
    assert len(encoded) == 1 + 5  # the header, then 1.2 MB in five chunks
    sent_async, sent_sync = raw_update_weights.calls
    assert sent_async == encoded and sent_sync == encoded


def test_errors_are_typed(server: RolloutServer) -> None:
    async def main():
        errors: list[BaseException] = []
        async with AsyncRolloutClient(server.address, timeout_s=WAIT_S) as client:
            current = (await client.health()).policy_version
            attempts = [
                client.make_experience([[5]], samples_per_prompt=0),
                client.make_experience(PROMPTS, min_policy_version=current + 100, **REQUEST),
                client.update_weights({NORM: torch.ones(64)}, version=current, mode="partial"),
                _first(client.stream_experience([[5]], samples_per_prompt=0)),
            ]
            for attempt in attempts:
                try:
                    await attempt
                except Exception as error:  # noqa: BLE001  (collected for the asserts)
                    errors.append(error)
        async with AsyncRolloutClient(f"127.0.0.1:{free_port()}", timeout_s=WAIT_S) as down:
            try:
                await down.health()
            except Exception as error:  # noqa: BLE001
                errors.append(error)
        return errors

    bad, too_new, stale, bad_stream, down = asyncio.run(main())
    assert isinstance(bad, InvalidArgument) and bad.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "samples_per_prompt" in bad.details
    assert isinstance(too_new, FailedPrecondition)
    assert isinstance(stale, FailedPrecondition) and "version" in stale.details
    assert isinstance(bad_stream, InvalidArgument)
    assert isinstance(down, Unavailable) and down.code == grpc.StatusCode.UNAVAILABLE


async def _first(stream):
    async for item in stream:
        return item
    return None


# ---- the scripted stand-in --------------------------------------------------------------------


def test_metadata_retries_and_deadlines(scripted) -> None:
    servicer, target = scripted
    servicer.script["Health"] = [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE]
    servicer.script["UpdateWeights"] = [grpc.StatusCode.UNAVAILABLE]
    servicer.script["MakeExperience"] = [HANG]

    async def main():
        async with AsyncRolloutClient(
            target, token=TOKEN, metadata=[("x-team", "rl")], timeout_s=WAIT_S
        ) as client:
            health = await client.health()  # two UNAVAILABLE, then served: retried by gRPC
            with pytest.raises(Unavailable):
                await client.update_weights(
                    {"w": torch.ones(4)},
                    version=1,
                    mode="partial",
                    request_id="upd-1",
                    transport="grpc",  # no Health probe: the script counts calls
                )
            with pytest.raises(DeadlineExceeded):
                await client.make_experience([[5]], timeout_s=0.2, request_id="exp-1")
            return health

    assert asyncio.run(main()).policy_version == SCRIPTED_VERSION
    assert servicer.methods() == ["Health"] * 3 + ["UpdateWeights", "MakeExperience"]
    for call in servicer.calls:
        assert call.metadata["authorization"] == f"Bearer {TOKEN}"
        assert call.metadata["x-team"] == "rl"
    assert servicer.calls[3].metadata["x-request-id"] == "upd-1"
    assert servicer.calls[4].metadata["x-request-id"] == "exp-1"
    assert servicer.calls[4].request_id == "exp-1"


def test_closing_an_async_stream_cancels_the_call(scripted) -> None:
    servicer, target = scripted
    servicer.script["MakeExperience"] = [ONE_THEN_HANG]

    async def main():
        async with AsyncRolloutClient(target, timeout_s=WAIT_S) as client:
            stream = client.stream_experience([[5]])
            first = await stream.__anext__()
            await stream.aclose()
            cancelled = await asyncio.to_thread(servicer.cancelled.wait, WAIT_S)
            return first, cancelled

    first, cancelled = asyncio.run(main())
    assert first.num_rows == 1 and cancelled


def test_mutual_tls(tls_server, pki: Pki) -> None:
    servicer, port = tls_server
    servicer.reset()

    async def main():
        async with AsyncRolloutClient(
            f"localhost:{port}",
            token=TOKEN,
            root_certificates=pki.ca,
            private_key=pki.client_key,
            certificate_chain=pki.client_chain,
        ) as client:
            return await client.health()

    assert asyncio.run(main()).policy_version == SCRIPTED_VERSION
    assert servicer.calls[0].metadata["authorization"] == f"Bearer {TOKEN}"


def test_updates_refused_while_still_sending_keep_the_servers_status(
    server: RolloutServer,
) -> None:
    # Refused at the WeightsHeader (a stale version) or at the safetensors header in the first
    # chunk (a name the model lacks) while the client still writes chunks: grpc.aio's failed
    # write used to replace the server's status with INTERNAL in about 1 of 5 such calls.
    weights = {NORM: torch.ones(64), "not.in.the.model": torch.zeros(4 << 20)}  # 16 MiB

    async def main() -> list[tuple[int, BaseException | None]]:
        outcomes: list[tuple[int, BaseException | None]] = []
        async with AsyncRolloutClient(server.address, timeout_s=WAIT_S) as client:
            current = (await client.health()).policy_version
            for attempt in range(12):
                version = current if attempt % 2 else current + 1  # odd: stale
                try:
                    await client.update_weights(
                        weights, version=version, mode="partial", transport="grpc"
                    )
                    outcomes.append((attempt, None))
                except Exception as error:  # noqa: BLE001  (collected for the asserts)
                    outcomes.append((attempt, error))
        return outcomes

    before = state_hash(server.state.models.actor.module)
    for attempt, error in asyncio.run(main()):
        expected = FailedPrecondition if attempt % 2 else InvalidArgument
        assert isinstance(error, expected), (attempt, error)
    assert state_hash(server.state.models.actor.module) == before
