"""Hardening, third round: inputs that got a wrong status, or changed what the server serves.

One in-process server on 127.0.0.1:0 serves the tiny model (its own loaded copy: the LoRA test
merges into it). Each case was a defect found by probing the public surface:

* UpdateWeights with a version of 2**63 or more was applied; Experience.policy_version is int64,
  so every later MakeExperience failed with INTERNAL, and versions never go back down. Now
  INVALID_ARGUMENT before any byte is received.
* A safetensors header entry whose dtype is a JSON list or object (unhashable) raised TypeError:
  INTERNAL. Now INVALID_ARGUMENT.
* A LoRA adapter of finite factors and alpha whose merge overflows (alpha / r * B @ A beyond
  float32) was applied with allow_non_finite off, and the server went on serving infinite
  weights. Now INVALID_ARGUMENT, checked for every module before any weight is written.
* A status message quoting a value of 4-byte UTF-8 characters was cut at 1024 characters, 12 KiB
  percent-encoded in the grpc-message trailer: over grpc's 8 KiB soft metadata limit, so about
  every other call ended RESOURCE_EXHAUSTED "received metadata size exceeds soft limit" instead
  of INVALID_ARGUMENT naming the field.
* The client sent a request_id of any length as x-request-id metadata: one past gRPC's 16 KiB
  metadata limit ended the call RESOURCE_EXHAUSTED (a code that says retry), and one over the
  server's 128 characters was silently replaced by a fresh id. Now ValueError before sending.
* A positive temperature near float32's smallest values (1e-40, a subnormal) and an infinite
  kl_coef or overlong_factor were accepted and gave NaN log-probs, advantages or rewards with
  status OK. Now INVALID_ARGUMENT naming the field.

After every refusal the server answers Health and the actor's weights and version are unchanged.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from helpers_server import serve_in_process
from helpers_weights import weights_and_version
from rollserve.client import RolloutClient
from rollserve.client.calls import MAX_REQUEST_ID_CHARS
from rollserve.client.protocol.errors import InvalidArgument
from rollserve.server.config import ServerConfig
from rollserve.server.experience.generation import MIN_TEMPERATURE
from rollserve.server.models import ModelSet, load_models
from rollserve.server.serving.app import RolloutServer
from rollserve.server.serving.status import MAX_MESSAGE_BYTES, bounded_message
from rollserve.v1 import rollout_pb2 as pb
from rollserve.v1 import rollout_pb2_grpc

CALL_S = 30.0  # bound on any call; never reached when things work
Q_PROJ = "model.layers.0.self_attn.q_proj"
K_PROJ = "model.layers.0.self_attn.k_proj"


@pytest.fixture(scope="module")
def models(tiny_actor_dir: Path) -> ModelSet:
    return load_models(ServerConfig(device="cpu", actor=str(tiny_actor_dir)))


@pytest.fixture(scope="module")
def server(models: ModelSet) -> Iterator[RolloutServer]:
    running = serve_in_process(models)
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def client(server: RolloutServer) -> Iterator[RolloutClient]:
    with RolloutClient(server.address, timeout_s=CALL_S) as opened:
        yield opened


@pytest.fixture(scope="module")
def stub(server: RolloutServer) -> Iterator[rollout_pb2_grpc.RolloutStub]:
    with grpc.insecure_channel(server.address) as channel:
        yield rollout_pb2_grpc.RolloutStub(channel)


def _experience(client: RolloutClient, **fields: object):
    return client.make_experience(
        [[1, 72, 101], [1, 50]],
        samples_per_prompt=2,
        max_new_tokens=4,
        seed=3,
        rewards=["exact_match"],
        gt_answers=["a", "b"],
        **fields,
    )


# ---- UpdateWeights -------------------------------------------------------------------------------


def test_a_version_beyond_int64_is_refused_and_experience_still_works(
    models: ModelSet, client: RolloutClient
) -> None:
    before = weights_and_version(models.actor.module, client)
    weights = {k: t.detach().clone() for k, t in models.actor.module.state_dict().items()}
    for version in (2**63, 2**64 - 1):
        with pytest.raises(InvalidArgument, match=r"header\.version: at most 2\*\*63 - 1"):
            client.update_weights(weights, version=version)
    assert weights_and_version(models.actor.module, client) == before
    experience = _experience(client)
    assert experience.policy_version.tolist() == [before[1]] * 4


@pytest.mark.parametrize("dtype", [["F32"], {"F32": 1}], ids=["list", "object"])
def test_a_dtype_that_is_not_a_string_is_invalid_argument(
    models: ModelSet, client: RolloutClient, stub: rollout_pb2_grpc.RolloutStub, dtype: object
) -> None:
    before = weights_and_version(models.actor.module, client)
    document = {f"{Q_PROJ}.weight": {"dtype": dtype, "shape": [1], "data_offsets": [0, 4]}}
    raw = json.dumps(document).encode()
    file = struct.pack("<Q", len(raw)) + raw + struct.pack("<f", 1.0)
    header = pb.WeightsHeader(
        version=before[1] + 1, mode=pb.UPDATE_MODE_PARTIAL, total_bytes=len(file)
    )
    messages = [
        pb.UpdateWeightsRequest(header=header),
        pb.UpdateWeightsRequest(chunk=pb.WeightsChunk(offset=0, data=file)),
    ]
    with pytest.raises(grpc.RpcError) as info:
        stub.UpdateWeights(iter(messages), timeout=CALL_S)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert "unsupported dtype" in info.value.details()
    assert weights_and_version(models.actor.module, client) == before


def _adapter(models: ModelSet, scales: dict[str, float], rank: int = 2) -> dict[str, torch.Tensor]:
    """PEFT factors for each module of `scales`, every element of A and B equal to its scale."""
    weights = models.actor.module.state_dict()
    adapter = {}
    for module, value in scales.items():
        out_features, in_features = weights[f"{module}.weight"].shape
        adapter[f"base_model.model.{module}.lora_A.weight"] = torch.full((rank, in_features), value)
        adapter[f"base_model.model.{module}.lora_B.weight"] = torch.full(
            (out_features, rank), value
        )
    return adapter


def test_a_lora_adapter_whose_merge_overflows_is_refused_and_writes_nothing(
    models: ModelSet, client: RolloutClient
) -> None:
    actor = models.actor.module
    lora = pb.LoraAdapter(rank=2, alpha=2.0)
    # A valid adapter first: the refused one must leave its merge (and its bases) as they are.
    version = client.health().policy_version + 1
    client.update_weights(_adapter(models, {Q_PROJ: 0.01}), version=version, mode="lora", lora=lora)
    before = weights_and_version(models.actor.module, client)
    # Finite factors and alpha (each checked as it arrived), but alpha / r * B @ A = 5e29 * 2e10
    # overflows float32 in k_proj. q_proj's merge is finite and differs from its weight now (it
    # takes the first adapter out), so a merge that wrote as it went would have changed it.
    overflowing = _adapter(models, {Q_PROJ: 0.0, K_PROJ: 1e5})
    with pytest.raises(InvalidArgument, match=rf"{K_PROJ}\.weight: merging the LoRA adapter"):
        client.update_weights(
            overflowing, version=version + 1, mode="lora", lora=pb.LoraAdapter(rank=2, alpha=1e30)
        )
    assert weights_and_version(models.actor.module, client) == before
    assert torch.isfinite(actor.state_dict()[f"{K_PROJ}.weight"]).all()
    # The same adapter without its overflowing module merges onto the same bases.
    client.update_weights(
        _adapter(models, {K_PROJ: 0.01}), version=version + 1, mode="lora", lora=lora
    )
    assert client.health().policy_version == version + 1
    # Back to the base weights (alpha 0), so the other tests see the model as loaded.
    client.update_weights(
        _adapter(models, {K_PROJ: 0.0}),
        version=version + 2,
        mode="lora",
        lora=pb.LoraAdapter(rank=2, alpha=0.0),
    )


def test_a_sane_adapter_is_known_finite_by_its_bound_alone() -> None:
    """The check merges twice only when the bound max|W| + |s| r max|A| max|B| says nothing."""
    from rollserve.server.weights.lora import _surely_finite

    weight, a, b = torch.randn(64, 32), torch.randn(4, 32) * 0.01, torch.randn(64, 4) * 0.01
    assert _surely_finite(weight, a, b, scale=2.0)
    assert _surely_finite(weight.to(torch.bfloat16), a, b, scale=2.0)
    assert not _surely_finite(weight, a * 1e22, b * 1e22, scale=2.0)  # the merge is checked
    assert not _surely_finite(weight.half(), a * 1e4, b * 1e4, scale=2.0)  # past fp16 65504 / 2
    nan = weight.clone()
    nan[0, 0] = float("nan")
    assert not _surely_finite(nan, a, b, scale=2.0)


# ---- MakeExperience --------------------------------------------------------------------------


def test_a_status_message_of_multibyte_characters_stays_under_the_metadata_limit(
    stub: rollout_pb2_grpc.RolloutStub,
) -> None:
    value = "\U0001f600" * 5000  # 4 bytes in UTF-8, 12 percent-encoded
    bounded = bounded_message(f"algorithm.preset: unknown {value!r}")
    assert len(bounded.encode()) <= MAX_MESSAGE_BYTES + 64
    assert bounded.startswith("algorithm.preset: unknown '\U0001f600")
    request = pb.MakeExperienceRequest(
        token_ids=pb.RaggedTokenIds(values=[1, 72], lengths=[2]),
        rewards=[pb.RewardTerm(source="exact_match")],
        gt_answers=["a"],
        algorithm=pb.AlgorithmOptions(preset=value),
    )
    # Each call used to fail about every other time; 8 in a row all passing by chance: 0.2 %.
    for _ in range(8):
        with pytest.raises(grpc.RpcError) as info:
            list(stub.MakeExperience(request, timeout=CALL_S))
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        assert info.value.details().startswith("algorithm.preset: unknown")


@pytest.mark.parametrize("temperature", [1e-40, 1e-30, MIN_TEMPERATURE / 2])
def test_a_temperature_whose_division_overflows_is_refused(
    client: RolloutClient, temperature: float
) -> None:
    with pytest.raises(InvalidArgument, match=r"sampling\.temperature must be 0 \(greedy\) or"):
        _experience(client, temperature=temperature)


def test_the_smallest_temperature_gives_finite_experience(client: RolloutClient) -> None:
    experience = _experience(client, temperature=MIN_TEMPERATURE)
    for name in ("action_log_probs", "rollout_log_probs", "kl", "advantages", "returns"):
        assert torch.isfinite(getattr(experience, name)).all(), name


@pytest.mark.parametrize(
    "algorithm",
    [{"kl_coef": math.inf}, {"overlong_factor": math.inf, "overlong_buffer": 2}],
    ids=["kl_coef", "overlong_factor"],
)
def test_an_infinite_coefficient_is_refused(client: RolloutClient, algorithm: dict) -> None:
    field = next(iter(algorithm))
    with pytest.raises(InvalidArgument, match=rf"algorithm\.{field}: must be in \[0, "):
        _experience(client, algorithm=algorithm)
    assert client.health().status == "SERVING"


@pytest.mark.parametrize("length", [MAX_REQUEST_ID_CHARS + 1, 100_000])
def test_the_client_refuses_a_request_id_the_server_would_not_take(
    client: RolloutClient, length: int
) -> None:
    with pytest.raises(ValueError, match=f"request_id must be at most {MAX_REQUEST_ID_CHARS}"):
        _experience(client, request_id="r" * length)
    # The longest one the server takes still travels.
    experience = _experience(client, request_id="r" * MAX_REQUEST_ID_CHARS)
    assert experience.sequences.shape[0] == 4
