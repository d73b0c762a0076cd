"""UpdateWeights over real gRPC: correctness, atomicity, versioning, concurrency, LoRA, chunk sizes.

In-process servers on 127.0.0.1:0 share one set of loaded tiny models (a 2-layer Llama whose MLP
weights are 512 KiB, so 256 KiB chunks split tensors); every test starts its own server, so
versions start at 0, but the weights carry over between tests: each test compares against the
weights it saw at its start. The --wait-for-weights test runs a real server subprocess.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers_weights import calls_checked, perturbed, state_hash, update_weights_requests
from rollserve.client.channel import open_channel
from rollserve.client.client import RolloutClient
from rollserve.client.protocol.errors import FailedPrecondition
from rollserve.server.config import ServerConfig
from rollserve.server.experience.scoring import action_log_probs
from rollserve.server.models import LoadedModel, ModelSet, load_models
from rollserve.server.models.default_model import (
    TinyModelSpec,
    build_byte_tokenizer,
    save_tiny_causal_lm,
)
from rollserve.server.serving.app import RolloutServer
from rollserve.server.weights import staging_arena
from rollserve.server.weights.checksum import crc32
from rollserve.v1 import rollout_pb2 as pb
from rollserve.v1 import rollout_pb2_grpc

KIB = 1024
MIB = 1024 * KIB
SPEC = TinyModelSpec(hidden_size=128, intermediate_size=1024)  # MLP weights: 512 KiB each
PROMPTS = [[1, 72, 101, 108, 108], [1, 50, 51], [1, 90, 91, 92, 93, 94]]
EXPERIENCE = dict(
    max_new_tokens=8,
    temperature=1.0,
    seed=7,
    rewards=["exact_match"],
    algorithm={"whitening": "none"},  # stream micro-batches as they are made
)
WAIT_S = 30.0  # bound on any wait for another thread; never reached when things work


# ---- fixtures and helpers ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def actor_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_causal_lm(tmp_path_factory.mktemp("uw-actor"), SPEC)


@pytest.fixture(scope="module")
def models(actor_dir: Path) -> ModelSet:
    return load_models(ServerConfig(device="cpu", actor=str(actor_dir)))


def _config(**overrides: object) -> ServerConfig:
    return ServerConfig(**{"host": "127.0.0.1", "port": 0, "device": "cpu", **overrides})


@pytest.fixture
def server(models: ModelSet) -> Iterator[RolloutServer]:
    with RolloutServer(_config(), models=models) as running:
        yield running


@pytest.fixture
def client(server: RolloutServer) -> Iterator[RolloutClient]:
    with RolloutClient(server.address, timeout_s=WAIT_S) as rollout:
        yield rollout


@pytest.fixture
def stub(server: RolloutServer) -> Iterator[rollout_pb2_grpc.RolloutStub]:
    channel = open_channel(server.address)
    yield rollout_pb2_grpc.RolloutStub(channel)
    channel.close()


def requests(state_dict, version: int, **options: object) -> list[pb.UpdateWeightsRequest]:
    options = {"target": "actor", "mode": "full", "chunk_bytes": 256 * KIB, **options}
    return list(update_weights_requests(state_dict, version=version, **options))


def rpc_code(stub: rollout_pb2_grpc.RolloutStub, messages: Iterable[pb.UpdateWeightsRequest]):
    """The status code of an UpdateWeights call (OK when it succeeds)."""
    try:
        stub.UpdateWeights(iter(messages), timeout=WAIT_S)
    except grpc.RpcError as error:
        return error.code()
    return grpc.StatusCode.OK


def teacher_forced(module: torch.nn.Module, experience) -> torch.Tensor:
    """The trainer's log-probs (B, A) of the experience's actions under `module`."""
    log_probs, _ = action_log_probs(
        module,
        experience.sequences,
        experience.attention_mask,
        experience.num_actions,
        forward_batch_size=64,
    )
    return log_probs


def assert_logprobs_match(experience, module: torch.nn.Module) -> None:
    mask = experience.action_mask
    expected = teacher_forced(module, experience)
    torch.testing.assert_close(experience.action_log_probs[mask], expected[mask])


class GatedRequests:
    """Yields `messages`; before message `gate_at` it signals `reached` and waits for `release`.

    After the gate it raises `error` if given, else goes on. Bounded waits only.
    """

    def __init__(
        self,
        messages: list[pb.UpdateWeightsRequest],
        gate_at: int,
        error: Exception | None = None,
    ) -> None:
        self.messages = messages
        self.gate_at = gate_at
        self.error = error
        self.reached = threading.Event()
        self.release = threading.Event()

    def __iter__(self) -> Iterator[pb.UpdateWeightsRequest]:
        for index, message in enumerate(self.messages):
            if index == self.gate_at:
                self.reached.set()
                self.release.wait(WAIT_S)
                if self.error is not None:
                    raise self.error
            yield message


# ---- the new weights are the trainer's --------------------------------------------------------


def test_server_logprobs_equal_the_trainer_models_after_an_update(
    models: ModelSet, client: RolloutClient
) -> None:
    trainer = copy.deepcopy(models.actor.module)  # float32 on the CPU, like the server's
    before = copy.deepcopy(trainer)
    trainer.load_state_dict(perturbed(trainer, seed=1))
    result = client.update_weights(trainer, version=1)
    assert (result.version, result.tensors) == (1, len(trainer.state_dict()))
    assert state_hash(models.actor.module) == state_hash(trainer)
    experience = client.make_experience(PROMPTS, gt_answers=["a", "b", "c"], **EXPERIENCE)
    assert experience.policy_version.tolist() == [1] * len(PROMPTS)
    assert_logprobs_match(experience, trainer)
    # The update really changed the scores: the old weights give other log-probs.
    stale = teacher_forced(before, experience)[experience.action_mask]
    assert (stale - experience.action_log_probs[experience.action_mask]).abs().max() > 1e-3


@pytest.mark.parametrize("chunk_bytes", [256 * KIB, 64 * MIB])
def test_chunk_sizes_round_trip_bit_exact(
    models: ModelSet, client: RolloutClient, chunk_bytes: int
) -> None:
    weights = perturbed(models.actor.module, seed=2)
    assert max(t.nbytes for t in weights.values()) > 256 * KIB  # tensors span chunks
    expected = state_hash_of(models.actor.module, weights)
    result = client.update_weights(weights, version=1, chunk_bytes=chunk_bytes)
    assert result.bytes > 256 * KIB
    assert state_hash(models.actor.module) == expected


def test_steady_state_updates_reuse_one_staging_arena(
    models: ModelSet, client: RolloutClient
) -> None:
    actor = models.actor.module
    arena = staging_arena(actor)
    # A full update on the CPU is adopted: the model's tensors become views of the staged
    # buffer, and the buffer they lived in becomes the next staging buffer (arena.py). After two
    # full updates the two buffers alternate: no more allocations.
    client.update_weights(perturbed(actor, seed=19), version=1)
    model_buffers = {t.untyped_storage().data_ptr() for t in actor.state_dict().values()}
    assert len(model_buffers) == 1  # every tensor is a view of one adopted buffer
    client.update_weights(perturbed(actor, seed=20), version=2)
    allocations, capacity_bytes = arena.allocations, arena.capacity_bytes
    assert capacity_bytes >= sum(t.nbytes for t in actor.state_dict().values())
    name = "model.layers.0.mlp.up_proj.weight"
    client.update_weights({name: actor.state_dict()[name] * 2}, version=3, mode="partial")
    weights = perturbed(actor, seed=21)
    expected = state_hash_of(actor, weights)
    client.update_weights(weights, version=4)
    assert {t.untyped_storage().data_ptr() for t in actor.state_dict().values()} == model_buffers
    # Smaller and equal updates write into the same warm buffer, and still land bit-exact.
    assert (arena.allocations, arena.capacity_bytes) == (allocations, capacity_bytes)
    assert state_hash(actor) == expected


# ---- failures leave the weights and the version untouched -------------------------------------


def _bad_crc(messages: list[pb.UpdateWeightsRequest]) -> list[pb.UpdateWeightsRequest]:
    messages[5].chunk.crc32 ^= 1
    return messages


def _bad_sha256(messages: list[pb.UpdateWeightsRequest]) -> list[pb.UpdateWeightsRequest]:
    messages[0].header.sha256 = "0" * 64
    return messages


def _unknown_name(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {**weights, "model.layers.0.mlp.no_such_proj.weight": torch.zeros(4)}


def _wrong_shape(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    name = "model.layers.1.mlp.up_proj.weight"
    return {**weights, name: weights[name][:-1].clone()}


def _truncated_in_a_tensor(messages: list[pb.UpdateWeightsRequest]):
    return messages[:-2]  # ends in the middle of the last tensors: 256 KiB chunks


BAD_STREAMS = {
    # name: (edit of the state dict, edit of the messages, version, status)
    "bad_crc32": (None, _bad_crc, 1, grpc.StatusCode.INVALID_ARGUMENT),
    "bad_sha256": (None, _bad_sha256, 1, grpc.StatusCode.INVALID_ARGUMENT),
    "unknown_tensor": (_unknown_name, None, 1, grpc.StatusCode.INVALID_ARGUMENT),
    "shape_mismatch": (_wrong_shape, None, 1, grpc.StatusCode.INVALID_ARGUMENT),
    "stream_ends_early": (None, _truncated_in_a_tensor, 1, grpc.StatusCode.INVALID_ARGUMENT),
    "version_not_above_current": (None, None, 0, grpc.StatusCode.FAILED_PRECONDITION),
}


@pytest.mark.parametrize("case", sorted(BAD_STREAMS))
def test_a_bad_stream_changes_nothing(
    models: ModelSet, client: RolloutClient, stub, case: str
) -> None:
    edit_weights, edit_messages, version, code = BAD_STREAMS[case]
    weights = perturbed(models.actor.module, seed=3)
    if edit_weights is not None:
        weights = edit_weights(weights)
    messages = requests(weights, version, sha256=case == "bad_sha256")
    if edit_messages is not None:
        messages = edit_messages(messages)
    before = state_hash(models.actor.module)
    assert rpc_code(stub, messages) == code
    assert state_hash(models.actor.module) == before
    assert client.health().policy_version == 0
    # The failed stream did not use up its version.
    assert client.update_weights(perturbed(models.actor.module, 4), version=1).version == 1


def test_the_same_version_twice_is_refused(models: ModelSet, client: RolloutClient) -> None:
    first = perturbed(models.actor.module, seed=5)
    client.update_weights(first, version=3)
    applied = state_hash(models.actor.module)
    with pytest.raises(FailedPrecondition, match="not above"):
        client.update_weights(perturbed(models.actor.module, seed=6), version=3)
    with pytest.raises(FailedPrecondition, match="not above"):
        client.update_weights(perturbed(models.actor.module, seed=6), version=2)
    assert state_hash(models.actor.module) == applied
    assert client.health().policy_version == 3


def test_a_partial_update_of_one_tensor_then_a_full_one(
    models: ModelSet, client: RolloutClient
) -> None:
    actor = models.actor.module
    before = {name: tensor.clone() for name, tensor in actor.state_dict().items()}
    name = "model.layers.0.mlp.down_proj.weight"
    one = {name: before[name] * 0.5}
    assert client.update_weights(one, version=1, mode="partial").tensors == 1
    after = actor.state_dict()
    assert torch.equal(after[name], one[name])
    assert all(torch.equal(after[n], t) for n, t in before.items() if n != name)
    full = perturbed(actor, seed=7)
    client.update_weights(full, version=2)
    assert all(torch.equal(actor.state_dict()[n], t) for n, t in full.items())
    assert client.health().policy_version == 2


CUT_POINTS = [1, 2, 8, -1]  # after the header, in the file header's chunk, mid-file, last chunk


@pytest.mark.parametrize("cut_at", CUT_POINTS)
def test_a_client_iterator_that_raises_mid_stream_changes_nothing(
    models: ModelSet, client: RolloutClient, stub, cut_at: int
) -> None:
    messages = requests(perturbed(models.actor.module, seed=8), version=1)
    gated = GatedRequests(messages, cut_at % len(messages), error=RuntimeError("trainer died"))
    gated.release.set()
    before = state_hash(models.actor.module)
    # grpc cancels the call and reports UNKNOWN ("Exception iterating requests!").
    assert rpc_code(stub, gated) == grpc.StatusCode.UNKNOWN
    assert state_hash(models.actor.module) == before
    assert client.health().policy_version == 0
    assert client.update_weights(perturbed(models.actor.module, 9), version=1).version == 1


def test_the_update_is_handed_its_call(
    models: ModelSet, client: RolloutClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """update.check_call applies an update only while its call is alive (its cases:
    tests/test_in_place_staging.py); here the servicer hands the stream's context over."""
    calls = calls_checked(monkeypatch)
    assert client.update_weights(perturbed(models.actor.module, 15), version=1).version == 1
    (call,) = calls
    assert isinstance(call, grpc.ServicerContext) and call.time_remaining() > 0


@pytest.mark.parametrize("cut_at", CUT_POINTS)
def test_a_cancelled_call_mid_stream_changes_nothing(
    models: ModelSet, client: RolloutClient, stub, cut_at: int
) -> None:
    messages = requests(perturbed(models.actor.module, seed=10), version=1)
    gated = GatedRequests(messages, cut_at % len(messages))
    before = state_hash(models.actor.module)
    future = stub.UpdateWeights.future(iter(gated), timeout=WAIT_S)
    try:
        assert gated.reached.wait(WAIT_S)
        assert future.cancel()
    finally:
        gated.release.set()
    assert future.code() == grpc.StatusCode.CANCELLED
    assert state_hash(models.actor.module) == before
    assert client.health().policy_version == 0
    assert client.update_weights(perturbed(models.actor.module, 11), version=1).version == 1


def test_a_deadline_that_expires_mid_stream_changes_nothing(
    models: ModelSet, client: RolloutClient, stub
) -> None:
    messages = requests(perturbed(models.actor.module, seed=12), version=1)
    gated = GatedRequests(messages, gate_at=len(messages) // 2)
    before = state_hash(models.actor.module)
    try:
        with pytest.raises(grpc.RpcError) as info:
            stub.UpdateWeights(iter(gated), timeout=1.0)  # the iterator stalls past it
    finally:
        gated.release.set()
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert state_hash(models.actor.module) == before
    assert client.health().policy_version == 0
    assert client.update_weights(perturbed(models.actor.module, 13), version=1).version == 1


# ---- atomicity against experience, serialised updates -----------------------------------------


def _stream_rows(client: RolloutClient, prompts, batches: list, first: threading.Event) -> None:
    for experience in client.stream_experience(
        prompts, gt_answers=["x"] * len(prompts), generate_batch_size=1, micro_batch_size=1,
        **EXPERIENCE,
    ):  # fmt: skip
        batches.append(experience)
        first.set()


def test_experience_made_during_an_update_carries_one_version(
    models: ModelSet, client: RolloutClient
) -> None:
    old = copy.deepcopy(models.actor.module)
    new = perturbed(old, seed=14)
    prompts = PROMPTS * 4  # 12 generation batches of one row: long enough to overlap
    batches: list = []
    first = threading.Event()
    maker = threading.Thread(target=_stream_rows, args=(client, prompts, batches, first))
    maker.start()
    try:
        assert first.wait(WAIT_S)  # the request is running on the engine
        assert client.update_weights(new, version=1).version == 1
    finally:
        maker.join(WAIT_S)
    assert len(batches) == len(prompts)
    for experience in batches:  # every row was made by the weights the request started on
        assert experience.policy_version.tolist() == [0]
        assert_logprobs_match(experience, old)
    after = client.make_experience(PROMPTS, gt_answers=["a", "b", "c"], **EXPERIENCE)
    assert after.policy_version.tolist() == [1] * len(PROMPTS)
    old.load_state_dict(new)
    assert_logprobs_match(after, old)


def test_experience_is_served_on_the_old_weights_while_an_update_streams(
    models: ModelSet, client: RolloutClient, stub
) -> None:
    old = copy.deepcopy(models.actor.module)
    new = perturbed(old, seed=15)
    gated = GatedRequests(requests(new, version=1), gate_at=6)
    future = stub.UpdateWeights.future(iter(gated), timeout=WAIT_S)
    try:
        assert gated.reached.wait(WAIT_S)  # half staged: nothing of it may be visible
        during = client.make_experience(PROMPTS, gt_answers=["a", "b", "c"], **EXPERIENCE)
    finally:
        gated.release.set()
    assert future.result(timeout=WAIT_S).version == 1
    assert during.policy_version.tolist() == [0] * len(PROMPTS)
    assert_logprobs_match(during, old)
    assert state_hash(models.actor.module) != state_hash(old)


def test_concurrent_updates_are_serialised(models: ModelSet, client: RolloutClient) -> None:
    for round_index in range(3):
        low, high = 2 * round_index + 1, 2 * round_index + 2
        weights = {v: perturbed(models.actor.module, seed=100 + v) for v in (low, high)}
        expected = {v: state_hash_of(models.actor.module, weights[v]) for v in (low, high)}
        outcomes: dict[int, str] = {}
        barrier = threading.Barrier(2)
        threads = [
            threading.Thread(target=_push, args=(client, weights[v], v, barrier, outcomes))
            for v in (low, high)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(WAIT_S)
        # The higher version always lands; the lower one only if it came first.
        assert outcomes[high] == "ok" and outcomes[low] in ("ok", "stale")
        health = client.health()
        assert health.policy_version == high
        assert state_hash(models.actor.module) == expected[health.policy_version]


def _push(client: RolloutClient, weights, version: int, barrier, outcomes: dict) -> None:
    barrier.wait(WAIT_S)  # both threads start their streams together
    try:
        client.update_weights(weights, version=version)
        outcomes[version] = "ok"
    except FailedPrecondition:
        outcomes[version] = "stale"


def state_hash_of(module: torch.nn.Module, weights: dict[str, torch.Tensor]) -> str:
    """state_hash the module would have with `weights` loaded (the module is not changed)."""
    shadow = copy.deepcopy(module)
    shadow.load_state_dict(weights)
    return state_hash(shadow)


# ---- LoRA over the wire -----------------------------------------------------------------------

LORA_MODULES = ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj")


def test_a_lora_adapter_sent_twice_merges_once(models: ModelSet, client: RolloutClient) -> None:
    rank, alpha = 4, 8.0
    actor = models.actor.module
    base = {name: tensor.clone() for name, tensor in actor.state_dict().items()}
    generator = torch.Generator().manual_seed(16)
    adapter = {}
    for module in LORA_MODULES:
        out_features, in_features = base[f"{module}.weight"].shape
        prefix = f"base_model.model.{module}"
        adapter[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator)
        adapter[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator)
    lora = pb.LoraAdapter(rank=rank, alpha=alpha)
    client.update_weights(adapter, version=1, mode="lora", lora=lora)
    once = state_hash(actor)
    client.update_weights(adapter, version=2, mode="lora", lora=lora)
    assert state_hash(actor) == once  # absolute, so idempotent
    merged = actor.state_dict()
    for name, tensor in base.items():
        module = name.removesuffix(".weight")
        if module not in LORA_MODULES:
            assert torch.equal(merged[name], tensor), name
            continue
        a = adapter[f"base_model.model.{module}.lora_A.weight"]  # (r, in)
        b = adapter[f"base_model.model.{module}.lora_B.weight"]  # (out, r)
        torch.testing.assert_close(merged[name], tensor + alpha / rank * (b @ a))
    assert client.health().policy_version == 2


# ---- 64 MiB chunks need messages a little larger than 64 MiB ----------------------------------


def _wide_embedding_models() -> ModelSet:
    """An actor whose embedding alone is > 64 MiB, so a 64 MiB chunk is a full message."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=140_000, hidden_size=128, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    module = LlamaForCausalLM(config).eval().requires_grad_(False)
    actor = LoadedModel("actor", module, "test:wide", "LlamaForCausalLM", "float32", 0)
    return ModelSet(
        actor=actor, tokenizer=build_byte_tokenizer(), reference=None, critic=None, reward=None,
        device=torch.device("cpu"), device_label="cpu", vocab_size=140_000, max_context_tokens=64,
    )  # fmt: skip


@pytest.mark.parametrize(
    "max_message_bytes",
    [
        pytest.param(None, id="default-limits"),
        pytest.param(65 * MIB, id="65-MiB-limits"),
    ],
)
def test_64_mib_chunks_carry_a_tensor_larger_than_a_chunk(max_message_bytes: int | None) -> None:
    models = _wide_embedding_models()
    name = "model.embed_tokens.weight"
    weight = torch.randn(models.actor.module.state_dict()[name].shape)
    assert weight.nbytes > 64 * MIB
    limits = {} if max_message_bytes is None else {"max_message_bytes": max_message_bytes}
    with RolloutServer(_config(**limits), models=models) as server:
        with RolloutClient(server.address, timeout_s=WAIT_S, **limits) as client:
            result = client.update_weights(
                {name: weight}, version=1, mode="partial", chunk_bytes=64 * MIB
            )
    assert result.tensors == 1
    assert torch.equal(models.actor.module.state_dict()[name], weight)


# ---- --wait-for-weights, through a real server process -----------------------------------------


def _start_waiting_server(actor_dir: Path, workdir: Path) -> tuple[subprocess.Popen, str]:
    """A `rollserve serve --wait-for-weights` process; returns once its port file exists."""
    port_file = workdir / "port"
    log = open(workdir / "server.log", "wb")  # noqa: SIM115 - closed by the caller's finally
    command = [
        sys.executable, "-m", "rollserve.server", "serve", "--host", "127.0.0.1", "--port", "0",
        "--port-file", str(port_file), "--device", "cpu", "--actor", str(actor_dir),
        "--wait-for-weights",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLSERVE_")}
    proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    deadline_s = time.monotonic() + 120
    while not port_file.exists():
        assert proc.poll() is None, (workdir / "server.log").read_text()
        assert time.monotonic() < deadline_s, "the server wrote no port file"
        time.sleep(0.1)
    return proc, f"127.0.0.1:{int(port_file.read_text())}"


def _probe(target: str, service: str = "") -> int:
    with grpc.insecure_channel(target) as channel:
        check = health_pb2.HealthCheckRequest(service=service)
        return health_pb2_grpc.HealthStub(channel).Check(check, timeout=10).status


def _wait_for_loaded(client: RolloutClient) -> None:
    deadline_s = time.monotonic() + 120
    while client.health().status == "LOADING":
        assert time.monotonic() < deadline_s, "the server never finished loading"
        time.sleep(0.1)


def test_wait_for_weights_serves_only_after_the_first_actor_update(actor_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    serving_code = health_pb2.HealthCheckResponse.SERVING
    with tempfile.TemporaryDirectory(prefix="rollserve-wfw-") as tmp:
        proc, target = _start_waiting_server(actor_dir, Path(tmp))
        try:
            with RolloutClient(target, timeout_s=WAIT_S) as client:
                _wait_for_loaded(client)
                waiting = client.health()
                assert (waiting.status, waiting.policy_version) == ("WAITING_FOR_WEIGHTS", 0)
                assert _probe(target) == not_serving
                assert _probe(target, "rollserve.v1.Rollout") == not_serving
                with pytest.raises(FailedPrecondition, match="waiting for its first weights"):
                    client.make_experience(PROMPTS, gt_answers=["a", "b", "c"], **EXPERIENCE)
                trainer = AutoModelForCausalLM.from_pretrained(actor_dir, dtype=torch.float32)
                trainer.load_state_dict(perturbed(trainer, seed=17))
                # A failed update is not "the first weights".
                with grpc.insecure_channel(target) as channel:
                    bad = _bad_crc(requests(trainer.state_dict(), version=1))
                    code = rpc_code(rollout_pb2_grpc.RolloutStub(channel), bad)
                assert code == grpc.StatusCode.INVALID_ARGUMENT
                assert client.health().status == "WAITING_FOR_WEIGHTS"
                assert _probe(target) == not_serving
                assert client.update_weights(trainer, version=1).version == 1
                serving = client.health()
                assert (serving.status, serving.policy_version) == ("SERVING", 1)
                assert _probe(target) == serving_code
                assert _probe(target, "rollserve.v1.Rollout") == serving_code
                experience = client.make_experience(
                    PROMPTS, gt_answers=["a", "b", "c"], **EXPERIENCE
                )
                assert experience.policy_version.tolist() == [1] * len(PROMPTS)
                assert_logprobs_match(experience, trainer.eval())
        finally:
            proc.terminate()
            assert proc.wait(timeout=60) == 0, (Path(tmp) / "server.log").read_text()


# ---- checksums -----------------------------------------------------------------------------------


def test_crc32_matches_zlib_on_chunks_and_views() -> None:
    data = os.urandom(3 * MIB + 7)
    view = memoryview(data)
    for piece in (b"", data, view[1 : 2 * MIB + 3], view[-5:]):
        assert crc32(piece) == zlib.crc32(piece)
