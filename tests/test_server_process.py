"""The serving skeleton end to end: real server processes and in-process servers on 127.0.0.1.

Most checks share one module-scoped server process (start-up costs seconds of imports); the
drain test starts its own, and the in-process tests share one set of loaded tiny models.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pool, message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from helpers_server import ServerProcess, free_port, start_server_process
from rollserve.client.protocol.errors import FailedPrecondition, InvalidArgument
from rollserve.server.config import ServerConfig
from rollserve.server.models import ModelLoadError, ModelSet, load_models
from rollserve.server.serving.app import BindError, RolloutServer
from rollserve.server.serving.status import INTERNAL_MESSAGE, handles_errors
from rollserve.v1 import rollout_pb2 as pb
from rollserve.v1 import rollout_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[ServerProcess, str]]:
    proc, port = start_server_process("--device", "cpu")
    yield proc, f"127.0.0.1:{port}"
    assert proc.terminate_and_wait() == 0, proc.log_text()


def _check(target: str, service: str = "") -> int:
    with grpc.insecure_channel(target) as channel:
        request = health_pb2.HealthCheckRequest(service=service)
        return health_pb2_grpc.HealthStub(channel).Check(request, timeout=5).status


def _rollout_health(target: str) -> pb.HealthResponse:
    with grpc.insecure_channel(target) as channel:
        return rollout_pb2_grpc.RolloutStub(channel).Health(pb.HealthRequest(), timeout=5)


# ---- one shared server process ----------------------------------------------------------------


def test_reflection_describes_the_services_to_a_client_without_our_stubs(server) -> None:
    _, target = server
    with grpc.insecure_channel(target) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        services = set(database.get_services())
        assert {"rollserve.v1.Rollout", "grpc.health.v1.Health"} <= services
        pool = descriptor_pool.DescriptorPool(database)
        rollout = pool.FindServiceByName("rollserve.v1.Rollout")
        methods = {method.name: method for method in rollout.methods}
        assert set(methods) == {
            "MakeExperience",
            "UpdateWeights",
            "UpdateWeightsAtOnce",
            "Health",
            "Subscribe",
            "InitWeightsGroup",
            "DestroyWeightsGroup",
        }
        make = methods["MakeExperience"]
        assert make.input_type.full_name == "rollserve.v1.MakeExperienceRequest"
        assert make.output_type.full_name == "rollserve.v1.MakeExperienceResponse"
        assert make.server_streaming and not make.client_streaming
        assert methods["UpdateWeights"].client_streaming
        at_once = methods["UpdateWeightsAtOnce"]
        assert not at_once.client_streaming and not at_once.server_streaming
        assert at_once.input_type.full_name == "rollserve.v1.UpdateWeightsAtOnceRequest"
        request_fields = {field.name for field in make.input_type.fields}
        expected_fields = {"token_ids", "texts", "sampling", "algorithm", "min_policy_version"}
        assert expected_fields <= request_fields
        # Call Health with message classes built from the reflected descriptors alone.
        health = methods["Health"]
        request_class = message_factory.GetMessageClass(health.input_type)
        response_class = message_factory.GetMessageClass(health.output_type)
        call = channel.unary_unary(
            "/rollserve.v1.Rollout/Health",
            request_serializer=request_class.SerializeToString,
            response_deserializer=response_class.FromString,
        )
        response = call(request_class(), timeout=5)
        assert response.vocab_size == 259
        status_enum = health.output_type.fields_by_name["status"].enum_type
        assert status_enum.values_by_number[response.status].name == "SERVING_STATUS_SERVING"


def test_standard_health_check_answers_serving(server) -> None:
    _, target = server
    assert _check(target) == SERVING
    assert _check(target, "rollserve.v1.Rollout") == SERVING
    with pytest.raises(grpc.RpcError) as info:
        _check(target, "no.such.Service")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_rollout_health_reports_the_builtin_actor(server) -> None:
    _, target = server
    response = _rollout_health(target)
    assert response.status == pb.SERVING_STATUS_SERVING
    assert response.vocab_size == 259
    assert response.max_context_tokens == 512
    assert response.device == "cpu"
    assert response.default_preset == "openrlhf"
    assert response.server_version and response.uptime_s > 0
    assert response.policy_version == 0 and response.queue_depth == 0
    roles = {model.role: model for model in response.models}
    assert set(roles) == {pb.MODEL_ROLE_ACTOR, pb.MODEL_ROLE_REFERENCE}
    actor = roles[pb.MODEL_ROLE_ACTOR]
    assert actor.source == "builtin:tiny-llama"
    assert actor.architecture == "LlamaForCausalLM"
    assert actor.dtype == "float32" and actor.num_parameters > 0
    assert roles[pb.MODEL_ROLE_REFERENCE].num_parameters == actor.num_parameters


def _health_command(target: str) -> subprocess.CompletedProcess[str]:
    # The probe must not pay for torch/transformers: assert it never imported them.
    code = (
        "import sys; from rollserve.server.serving.cli import main; rc = main(sys.argv[1:]); "
        "heavy = {'torch', 'transformers'} & set(sys.modules); assert not heavy, heavy; "
        "sys.exit(rc)"
    )
    return subprocess.run(
        [sys.executable, "-c", code, "health", "--target", target, "--timeout-s", "5"],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_health_command_exits_0_when_serving(server) -> None:
    _, target = server
    result = _health_command(target)
    assert result.returncode == 0, result.stderr
    assert "SERVING" in result.stdout


def test_health_command_exits_1_when_nothing_listens() -> None:
    result = _health_command(f"127.0.0.1:{free_port()}")
    assert result.returncode == 1, result.stderr
    assert "UNAVAILABLE" in result.stdout


def test_module_health_command_is_the_same_cli(server) -> None:
    _, target = server
    command = [sys.executable, "-m", "rollserve.server", "health", "--target", target]
    assert subprocess.run(command, capture_output=True, timeout=60).returncode == 0


def test_the_default_server_makes_experience_and_refuses_bad_requests(server) -> None:
    _, target = server
    with grpc.insecure_channel(target) as channel:
        stub = rollout_pb2_grpc.RolloutStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.MakeExperience(pb.MakeExperienceRequest(), timeout=30))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "prompts" in info.value.details()
        with pytest.raises(grpc.RpcError) as info:
            stub.UpdateWeights(iter([pb.UpdateWeightsRequest()]), timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        request = pb.MakeExperienceRequest(
            token_ids=pb.RaggedTokenIds(values=[5, 6, 7], lengths=[3]),
            samples_per_prompt=2,
            sampling=pb.SamplingOptions(max_new_tokens=4, seed=7),
            rewards=[pb.RewardTerm(source="exact_match")],
            gt_answers=["x"],
        )
        (reply,) = list(stub.MakeExperience(request, timeout=60))
        assert reply.num_micro_batches == 1
        assert list(reply.experience.sequences.shape)[0] == 2


# ---- processes of their own -------------------------------------------------------------------


def test_sigterm_drains_then_exits_0_and_port_comes_from_environment() -> None:
    port = free_port()
    env = {"ROLLSERVE_PORT": str(port), "ROLLSERVE_DRAIN_DELAY_S": "2"}
    proc, bound = start_server_process("--device", "cpu", "--shutdown-grace-s", "5", env=env)
    try:
        assert bound == port
        target = f"127.0.0.1:{port}"
        proc.send_signal(signal.SIGTERM)
        # During the drain delay the process is still up and says NOT_SERVING on both views.
        deadline_s = time.monotonic() + 10
        while _check(target) != NOT_SERVING:
            assert time.monotonic() < deadline_s, "health never went NOT_SERVING"
            time.sleep(0.05)
        assert _check(target, "rollserve.v1.Rollout") == NOT_SERVING
        assert _rollout_health(target).status == pb.SERVING_STATUS_DRAINING
        assert proc.wait(timeout=30) == 0
    finally:
        proc.terminate_and_wait()
    log = proc.log_text()
    assert "SIGTERM" in log and "Traceback" not in log, log


def test_bad_model_directory_fails_startup_with_a_clear_message(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    command = [sys.executable, "-m", "rollserve.server", "--port", "0", "--critic", str(missing)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert f"critic model directory does not exist: {missing}" in result.stderr
    assert "Traceback" not in result.stderr


# ---- in-process servers -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_models() -> ModelSet:
    return load_models(ServerConfig(device="cpu"))


def _config(**overrides) -> ServerConfig:
    return ServerConfig(**{"host": "127.0.0.1", "port": 0, "device": "cpu", **overrides})


def test_in_process_server_lifecycle(tiny_models: ModelSet) -> None:
    server = RolloutServer(_config(), models=tiny_models)
    port = server.bind()
    target = f"127.0.0.1:{port}"
    # Bound but not loaded: answering, and saying so.
    assert _check(target) == NOT_SERVING
    loading = _rollout_health(target)
    assert loading.status == pb.SERVING_STATUS_LOADING and not loading.models
    server.load()
    assert _check(target) == SERVING
    assert _rollout_health(target).status == pb.SERVING_STATUS_SERVING
    server.stop(0)
    assert server.wait(timeout_s=10)
    with pytest.raises(grpc.RpcError) as info:
        _check(target)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_wait_for_weights_is_not_serving(tiny_models: ModelSet) -> None:
    with RolloutServer(_config(wait_for_weights=True), models=tiny_models) as server:
        target = f"127.0.0.1:{server.port}"
        assert _rollout_health(target).status == pb.SERVING_STATUS_WAITING_FOR_WEIGHTS
        assert _check(target) == NOT_SERVING


def test_port_in_use_is_a_bind_error(tiny_models: ModelSet) -> None:
    with RolloutServer(_config(), models=tiny_models) as first:
        second = RolloutServer(_config(port=first.port), models=tiny_models)
        with pytest.raises(BindError, match=str(first.port)):
            second.bind()


def test_port_file_holds_the_bound_port(tiny_models: ModelSet, tmp_path: Path) -> None:
    port_file = tmp_path / "port"
    with RolloutServer(_config(port_file=str(port_file)), models=tiny_models) as server:
        assert int(port_file.read_text()) == server.port


# ---- model loading ----------------------------------------------------------------------------


def test_loads_critic_reward_and_reference_directories(
    tiny_actor_dir: Path, tiny_critic_dir: Path, tiny_reward_dir: Path
) -> None:
    models = load_models(
        ServerConfig(
            device="cpu",
            actor=str(tiny_actor_dir),
            reference=str(tiny_actor_dir),
            critic=str(tiny_critic_dir),
            reward_model=str(tiny_reward_dir),
        )
    )
    assert [model.role for model in models.loaded()] == ["actor", "reference", "critic", "reward"]
    assert models.critic.architecture == "LlamaForTokenClassification"
    assert models.reward.architecture == "LlamaForSequenceClassification"
    assert models.reference.source == str(tiny_actor_dir)
    for model in models.loaded():
        assert not model.module.training
        assert not any(p.requires_grad for p in model.module.parameters())
    assert models.tokenizer.pad_token_id == 0 and models.vocab_size == 259


def test_default_reference_is_an_independent_copy(tiny_models: ModelSet) -> None:
    actor = dict(tiny_models.actor.module.named_parameters())
    reference = dict(tiny_models.reference.module.named_parameters())
    assert actor.keys() == reference.keys()
    name = next(iter(actor))
    assert actor[name].equal(reference[name])
    assert actor[name].data_ptr() != reference[name].data_ptr()


def test_causal_lm_directory_is_not_accepted_as_a_critic(tiny_actor_dir: Path) -> None:
    # It would load with a randomly initialised value head; that must be an error, not a warning.
    with pytest.raises(ModelLoadError, match="critic"):
        load_models(ServerConfig(device="cpu", critic=str(tiny_actor_dir)))


# ---- status mapping ---------------------------------------------------------------------------


class _Raiser:
    """Handlers that fail in each way status.handles_errors must map."""

    @handles_errors
    def domain(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        raise InvalidArgument("samples_per_prompt must be >= 1")

    @handles_errors
    def bug(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        raise KeyError("secret_internal_name")

    @handles_errors
    def stream_domain(self, request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        yield b"first"
        raise FailedPrecondition("policy version 3 < 5")

    @handles_errors
    def stream_bug(self, request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        yield b"first"
        raise RuntimeError("secret_internal_name")

    @handles_errors
    def ok(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        return request


@pytest.fixture(scope="module")
def raiser_target() -> Iterator[str]:
    from concurrent.futures import ThreadPoolExecutor

    raiser = _Raiser()
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(getattr(raiser, name))
        for name in ("domain", "bug", "ok")
    }
    handlers.update(
        {
            name: grpc.unary_stream_rpc_method_handler(getattr(raiser, name))
            for name in ("stream_domain", "stream_bug")
        }
    )
    server = grpc.server(ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.Raiser", handlers)])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(0)


@pytest.mark.parametrize(
    ("method", "code", "details"),
    [
        ("domain", grpc.StatusCode.INVALID_ARGUMENT, "samples_per_prompt must be >= 1"),
        ("bug", grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE),
        ("stream_domain", grpc.StatusCode.FAILED_PRECONDITION, "policy version 3 < 5"),
        ("stream_bug", grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE),
    ],
)
def test_exceptions_map_to_statuses_without_leaking_internals(
    raiser_target: str, method: str, code: grpc.StatusCode, details: str
) -> None:
    with grpc.insecure_channel(raiser_target) as channel:
        path = f"/test.Raiser/{method}"
        streaming = method.startswith("stream")
        call = channel.unary_stream(path) if streaming else channel.unary_unary(path)
        with pytest.raises(grpc.RpcError) as info:
            result = call(b"x", timeout=5)
            if streaming:
                assert next(result) == b"first"  # items before the failure still arrive
                list(result)
        assert info.value.code() == code
        assert info.value.details() == details
        assert "secret" not in info.value.details()


def test_successful_handler_passes_through(raiser_target: str) -> None:
    with grpc.insecure_channel(raiser_target) as channel:
        assert channel.unary_unary("/test.Raiser/ok")(b"payload", timeout=5) == b"payload"
