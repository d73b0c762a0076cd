"""Fuzz: malformed requests to every RPC of a real server process get a clear client-error status.

A fixed-seed sample of tests/helpers_fuzz.py's cases (random and bit-flipped bytes, field
mutations of MakeExperience and Subscribe requests, lying or broken UpdateWeights streams) runs
against one `rollserve serve` subprocess. Every call must end with INVALID_ARGUMENT,
FAILED_PRECONDITION or RESOURCE_EXHAUSTED and a message, or OK where the mutation left a valid
request; never INTERNAL or UNKNOWN, never a deadline; the process stays up, and afterwards its
weights give the same greedy log-probs as before. The long campaign (10,000+ cases) is
bench/soak.py.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2
from helpers_fuzz import FuzzReport, WeightsStreams, base_experience_request, fuzz_cases, run_case
from helpers_server import ServerProcess, greedy_snapshot, start_server_process
from rollserve.client.client import RolloutClient
from rollserve.client.protocol.errors import InvalidArgument
from rollserve.server.config import ServerConfig
from rollserve.server.models import ModelSet, load_models
from rollserve.v1 import rollout_pb2 as pb

SEED = 20261124
CASES = int(os.environ.get("ROLLSERVE_TEST_FUZZ_CASES", "600"))
CALL_TIMEOUT_S = 30.0  # a call that reaches it is a hang


@pytest.fixture(scope="module")
def models(tiny_actor_dir: Path) -> ModelSet:
    return load_models(ServerConfig(device="cpu", actor=str(tiny_actor_dir)))


@pytest.fixture(scope="module")
def server(tiny_actor_dir: Path) -> Iterator[tuple[ServerProcess, str]]:
    proc, port = start_server_process(
        "--actor", str(tiny_actor_dir), "--device", "cpu", "--metrics-port", "0"
    )
    try:
        yield proc, f"127.0.0.1:{port}"
    finally:
        assert proc.terminate_and_wait() == 0


@pytest.fixture(scope="module")
def channel(server) -> Iterator[grpc.Channel]:
    options = [("grpc.max_send_message_length", 64 << 20)]
    with grpc.insecure_channel(server[1], options=options) as opened:
        yield opened


# One undecodable message per method (0x0a 0x05: a length-delimited field 1 running past the end).
_UNDECODABLE = b"\x0a\x05\x01"
_METHODS = [
    ("/rollserve.v1.Rollout/MakeExperience", "unary_stream"),
    ("/rollserve.v1.Rollout/Health", "unary_unary"),
    ("/rollserve.v1.Rollout/Subscribe", "unary_stream"),
    ("/grpc.health.v1.Health/Check", "unary_unary"),
    ("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", "stream_stream"),
]


@pytest.mark.parametrize("method, kind", _METHODS)
def test_undecodable_request_bytes_are_invalid_argument(channel, method: str, kind: str) -> None:
    # Regression: grpc answered these with INTERNAL "Exception deserializing request!".
    with pytest.raises(grpc.RpcError) as info:
        if kind == "unary_unary":
            channel.unary_unary(method)(_UNDECODABLE, timeout=CALL_TIMEOUT_S)
        elif kind == "unary_stream":
            list(channel.unary_stream(method)(_UNDECODABLE, timeout=CALL_TIMEOUT_S))
        else:
            list(channel.stream_stream(method)(iter([_UNDECODABLE]), timeout=CALL_TIMEOUT_S))
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert "request: the bytes do not parse as" in info.value.details()


def test_valid_requests_still_pass_the_undecodable_check(channel) -> None:
    check = channel.unary_unary(
        "/grpc.health.v1.Health/Check",
        request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
        response_deserializer=health_pb2.HealthCheckResponse.FromString,
    )
    assert check(health_pb2.HealthCheckRequest(), timeout=CALL_TIMEOUT_S).status == 1  # SERVING
    reflect = channel.stream_stream(
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    (response,) = list(reflect(iter([request]), timeout=CALL_TIMEOUT_S))
    names = {service.name for service in response.list_services_response.service}
    assert "rollserve.v1.Rollout" in names
    rows = list(
        channel.unary_stream(
            "/rollserve.v1.Rollout/MakeExperience",
            response_deserializer=pb.MakeExperienceResponse.FromString,
        )(base_experience_request().SerializeToString(), timeout=CALL_TIMEOUT_S)
    )
    assert rows and rows[0].experience.sequences.shape[0] == 4


def test_a_fixed_seed_fuzz_sample_gets_only_client_error_statuses(
    server, channel, models: ModelSet
) -> None:
    proc, target = server
    log_probs_before, _ = greedy_snapshot(target)
    with RolloutClient(target) as client:
        version = {"now": client.health().policy_version}
    start_version = version["now"]
    streams = WeightsStreams(models.actor.module.state_dict())
    report = FuzzReport()
    cases = fuzz_cases(
        SEED,
        CASES,
        vocab_size=models.vocab_size,
        streams=streams,
        next_version=lambda: version["now"] + 1,
    )
    for case in cases:
        outcome = run_case(channel, case, CALL_TIMEOUT_S)
        report.add(outcome)
        if case.method == "UpdateWeights" and outcome.code is grpc.StatusCode.OK:
            version["now"] += 1
        assert proc.poll() is None, f"server died on {case.category} {case.note}"
    bad = [
        f"{o.case.category} {o.case.method} [{o.case.note[:80]}]: {o.code.name} {o.details[:120]}"
        for o in report.bad
    ]
    assert not bad, "\n".join(bad[:20])
    assert report.total == CASES
    # The streams carried the served weights: any accepted one changed the version only.
    log_probs_after, stamped = greedy_snapshot(target)
    assert log_probs_after == log_probs_before
    assert stamped == version["now"] == start_version + report.accepted_updates


def _products(batch_field: str, value: int) -> pb.MakeExperienceRequest:
    """4096 one-token prompts x 500 new tokens: every count within its own limit."""
    request = base_experience_request()
    request.samples_per_prompt = 1
    request.token_ids.Clear()
    request.token_ids.values.extend([5] * 4096)
    request.token_ids.lengths.extend([1] * 4096)
    del request.gt_answers[:]
    request.gt_answers.extend(["1"] * 4096)
    request.sampling.max_new_tokens = 500
    setattr(request.batching, batch_field, value)
    return request


@pytest.mark.parametrize("batch_field", ["generate_batch_size", "forward_batch_size"])
def test_legal_counts_whose_product_is_huge_are_refused_naming_the_field(
    channel, batch_field: str
) -> None:
    # Regression: 4096 rows x 501 tokens in one generation batch was accepted (a 4096-row batch
    # of 65 tokens alone ran past 60 s and 1.2 GB on the tiny model); now --max-batch-tokens.
    request = _products(batch_field, 4096)
    with pytest.raises(grpc.RpcError) as info:
        list(channel.unary_stream("/rollserve.v1.Rollout/MakeExperience")(
            request.SerializeToString(), timeout=CALL_TIMEOUT_S
        ))  # fmt: skip
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert f"batching.{batch_field}" in info.value.details()
    assert "--max-batch-tokens" in info.value.details()


def test_token_budgets_of_a_request(models: ModelSet) -> None:
    from rollserve.server.experience.request import RequestDefaults, decode_experience_request
    from rollserve.server.experience.rewards import RewardRegistry

    def decode(request: pb.MakeExperienceRequest, **budgets: int):
        defaults = RequestDefaults("openrlhf", 64, 64, 16, 16, 4096, **budgets)
        return decode_experience_request(
            request, models=models, rewards=RewardRegistry.from_specs([]), defaults=defaults
        )

    request = _products("generate_batch_size", 0)  # batch sizes unset: the server's defaults
    with pytest.raises(InvalidArgument, match="--max-request-tokens"):
        decode(request, max_request_tokens=4096 * 501 - 1)
    # Unset batch sizes shrink to fit the batch budget, in whole groups of samples.
    spec = decode(request, max_request_tokens=4096 * 501, max_batch_tokens=10 * 501)
    assert (spec.generate_batch_rows, spec.forward_batch_rows) == (10, 10)
    # 4 prompts x 3 samples: a batch holds whole groups of 3 rows.
    request.token_ids.Clear()
    request.token_ids.values.extend([5] * 4)
    request.token_ids.lengths.extend([1] * 4)
    del request.gt_answers[4:]
    request.samples_per_prompt = 3
    assert decode(request, max_batch_tokens=7 * 501).generate_batch_rows == 6
    with pytest.raises(InvalidArgument, match="samples_per_prompt: one group of 3 rows"):
        decode(request, max_batch_tokens=2 * 501)


@pytest.mark.parametrize("field", ["preset", "kl_mode", "whitening"])
def test_an_oversized_name_is_invalid_argument_with_a_bounded_message(channel, field) -> None:
    # Regression: the message quoted all 70,000 characters, the status details outgrew HTTP/2's
    # 16 KiB metadata limit, and the client got RESOURCE_EXHAUSTED "received metadata size
    # exceeds hard limit" instead of INVALID_ARGUMENT naming the field.
    request = base_experience_request()
    setattr(request.algorithm, field, "A" * 70_000)
    with pytest.raises(grpc.RpcError) as info:
        list(channel.unary_stream("/rollserve.v1.Rollout/MakeExperience")(
            request.SerializeToString(), timeout=CALL_TIMEOUT_S
        ))  # fmt: skip
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert info.value.details().startswith(f"algorithm.{field}")
    assert len(info.value.details()) < 1100


ENGINE_CASES = int(os.environ.get("ROLLSERVE_TEST_FUZZ_ENGINE_CASES", "500"))


def test_field_mutations_on_the_engine_path_get_only_client_error_statuses(
    tiny_actor_dir: Path, models: ModelSet
) -> None:
    # A CUDA server generates and scores on rollserve's engine by default (the CPU: on the HF
    # path, as the server above); its sampling, prefill and scoring take the same mutated
    # requests here, forced onto the engine on the CPU.
    proc, port = start_server_process(
        "--actor", str(tiny_actor_dir), "--device", "cpu", "--generation-path", "rollserve",
        "--metrics-port", "0",
    )  # fmt: skip
    try:
        target = f"127.0.0.1:{port}"
        with RolloutClient(target) as client:
            assert client.health().generation_path == "rollserve"
        streams = WeightsStreams(models.actor.module.state_dict())
        cases = [
            case
            for case in fuzz_cases(
                SEED + 1,
                ENGINE_CASES,
                vocab_size=models.vocab_size,
                streams=streams,
                next_version=lambda: 1,
            )  # fmt: skip
            if case.method == "MakeExperience"
        ]
        report = FuzzReport()
        with grpc.insecure_channel(target) as channel:
            for case in cases:
                report.add(run_case(channel, case, CALL_TIMEOUT_S))
                assert proc.poll() is None, f"server died on {case.category} {case.note}"
        bad = [f"[{o.case.note[:80]}]: {o.code.name} {o.details[:120]}" for o in report.bad]
        assert not bad, "\n".join(bad[:20])
        assert report.total == len(cases) > ENGINE_CASES // 4
        assert report.code_total("OK") > 0  # valid mutations were served
    finally:
        assert proc.terminate_and_wait() == 0
