"""AsyncRolloutClient: every RPC against a real in-process server, and the transport behaviour
(metadata, retries, deadlines, cancellation, TLS) against the scripted stand-in of
tests/test_client.py.

Each test runs its own event loop (asyncio.run) and opens its client inside it, as grpc.aio
requires; the module's server keeps its policy version between tests, so tests read the
current version first.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Iterator, Mapping

import grpc
import pytest
import test_client
import torch
from helpers_server import free_port
from rollserve.client.aio import AsyncRolloutClient
from rollserve.client.client import RolloutClient
from rollserve.client.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    Unavailable,
)
from rollserve.client.experience import Experience, concat_experiences
from rollserve.server.app import RolloutServer
from rollserve.server.config import ServerConfig
from rollserve.server.models import ModelSet, load_models
from test_client import HANG, ONE_THEN_HANG, SCRIPTED_VERSION, TOKEN, WAIT_S, Pki

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
            assert all(torch.equal(x[k], y[k]) for k in x), field.name
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
    progress: list[tuple[int, int]] = []

    async def main():
        async with AsyncRolloutClient(server.address, timeout_s=WAIT_S) as client:
            version = (await client.health()).policy_version + 1
            loop_thread = threading.get_ident()
            result = await client.update_weights(
                weights, version=version, mode="partial",
                progress=lambda sent, total: progress.append((sent, total)),
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
    assert progress[-1] == (result.bytes, result.bytes) and progress[0][0] == 0


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
                    {"w": torch.ones(4)}, version=1, mode="partial", request_id="upd-1"
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
