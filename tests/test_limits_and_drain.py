"""Limits, the bounded queue, deadlines, cancellation, graceful drain and deep readiness.

"Long" requests generate one row at a time (generate_batch_size 1) for a thousand rows: minutes
of work on the tiny model, while the follow-up requests that prove the engine was freed need a
fraction of a second. A follow-up only finishes within its deadline if the engine stopped
working on the abandoned request at its next batch.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import signal
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
import safetensors.torch
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers_server import ServerProcess, free_port, start_server_process
from helpers_wait import wait_until as wait_until_within
from prometheus_client.parser import text_string_to_metric_families
from rollserve.client.protocol.errors import InvalidArgument
from rollserve.v1 import rollout_pb2 as pb
from rollserve.v1 import rollout_pb2_grpc

WAIT_S = 60.0  # bound on any wait; never reached when things work
wait_for = functools.partial(wait_until_within, within_s=WAIT_S)
MAKE = {"service": "rollserve.v1.Rollout", "method": "MakeExperience"}


def make_request(rows: int, max_new_tokens: int = 2, **fields) -> pb.MakeExperienceRequest:
    """`rows` prompts, one row per generation batch and per micro-batch."""
    return pb.MakeExperienceRequest(
        token_ids=pb.RaggedTokenIds(values=[5, 6, 7] * rows, lengths=[3] * rows),
        sampling=pb.SamplingOptions(max_new_tokens=max_new_tokens, seed=5, ignore_eos=True),
        rewards=[pb.RewardTerm(source="exact_match")],
        gt_answers=["x"] * rows,
        batching=pb.BatchingOptions(micro_batch_size=1, generate_batch_size=1),
        algorithm=pb.AlgorithmOptions(whitening="none"),  # stream rows as they are made
        **fields,
    )


def long_request() -> pb.MakeExperienceRequest:
    return make_request(rows=1024, max_new_tokens=32)


def metric(metrics_port: int, name: str, **labels: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=WAIT_S) as r:
        text = r.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return 0.0


# ---- one server with tight limits and a queue of one ----------------------------------------


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[ServerProcess, str, int]]:
    metrics_port = free_port()
    proc, port = start_server_process(
        "--device", "cpu",
        "--max-queue-depth", "1",
        "--max-prompts", "1024",
        "--max-samples-per-prompt", "4",
        "--max-new-tokens-limit", "64",
        "--metrics-port", str(metrics_port),
    )  # fmt: skip
    yield proc, f"127.0.0.1:{port}", metrics_port
    assert proc.terminate_and_wait() == 0, proc.log_text()


@pytest.fixture
def stub(server) -> Iterator[rollout_pb2_grpc.RolloutStub]:
    with grpc.insecure_channel(server[1]) as channel:
        yield rollout_pb2_grpc.RolloutStub(channel)


def assert_engine_is_free(stub: rollout_pb2_grpc.RolloutStub) -> None:
    """A small request completes within WAIT_S: nothing long holds or waits for the engine."""
    # With a queue of one, a follow-up is refused until abandoned queued requests have left it.
    wait_for(
        lambda: stub.Health(pb.HealthRequest(), timeout=WAIT_S).queue_depth == 0,
        "the queue to empty",
    )
    replies = list(stub.MakeExperience(make_request(rows=1), timeout=WAIT_S))
    assert len(replies) == 1


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"rows": 1025}, "prompts: 1025 is over this server's limit of 1024 (--max-prompts)"),
        ({"samples_per_prompt": 5}, "samples_per_prompt: 5 is over this server's limit of 4"),
        ({"max_new_tokens": 65}, "sampling.max_new_tokens: 65 is over this server's limit of 64"),
    ],
)
def test_requests_over_the_limits_are_invalid_arguments(stub, fields: dict, message: str) -> None:
    fields = {"rows": 1, **fields}
    with pytest.raises(grpc.RpcError) as info:
        list(stub.MakeExperience(make_request(**fields), timeout=WAIT_S))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in info.value.details()


def test_a_full_queue_answers_resource_exhausted(server, stub) -> None:
    _, _, metrics_port = server
    rejected_before = metric(
        metrics_port, "rollserve_rpc_rejected_total", **MAKE, code="RESOURCE_EXHAUSTED"
    )
    running = stub.MakeExperience(long_request(), timeout=300)
    try:
        next(running)  # the engine is busy with it
        waiting = stub.MakeExperience(long_request(), timeout=300)
        try:
            wait_for(
                lambda: stub.Health(pb.HealthRequest(), timeout=WAIT_S).queue_depth == 1,
                "the second request to queue",
            )
            assert metric(metrics_port, "rollserve_queue_depth") == 1
            with pytest.raises(grpc.RpcError) as info:
                list(stub.MakeExperience(make_request(rows=1), timeout=WAIT_S))
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "queue is full" in info.value.details()
        finally:
            waiting.cancel()
    finally:
        running.cancel()
    rejected_after = metric(
        metrics_port, "rollserve_rpc_rejected_total", **MAKE, code="RESOURCE_EXHAUSTED"
    )
    assert rejected_after == rejected_before + 1
    # Both abandoned requests stop using the engine: the running one at its next batch, the
    # queued one as soon as it starts.
    assert_engine_is_free(stub)


def test_a_cancelled_request_frees_the_engine(server, stub) -> None:
    _, _, metrics_port = server
    cancelled_before = metric(metrics_port, "rollserve_rpc_handled_total", **MAKE, code="CANCELLED")
    running = stub.MakeExperience(long_request(), timeout=300)
    first = next(running)
    assert first.num_micro_batches == 1024
    running.cancel()
    assert_engine_is_free(stub)
    wait_for(
        lambda: (
            metric(metrics_port, "rollserve_rpc_handled_total", **MAKE, code="CANCELLED")
            == cancelled_before + 1
        ),
        "the server to record the cancellation",
    )


def test_an_expired_deadline_frees_the_engine(server, stub) -> None:
    _, _, metrics_port = server
    name, code = "rollserve_rpc_handled_total", "DEADLINE_EXCEEDED"
    expired_before = metric(metrics_port, name, **MAKE, code=code)
    with pytest.raises(grpc.RpcError) as info:
        list(stub.MakeExperience(long_request(), timeout=3))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert_engine_is_free(stub)
    wait_for(
        lambda: metric(metrics_port, name, **MAKE, code=code) == expired_before + 1,
        "the server to record the expired deadline",
    )


def test_limits_are_checked_where_the_request_is_decoded_before_any_tokenization(
    tiny_models,
) -> None:
    from rollserve.server.experience.request import RequestDefaults, decode_experience_request
    from rollserve.server.experience.rewards import RewardRegistry

    limits = RequestDefaults(
        "openrlhf", 8, 64, 16, 16, 4096, max_prompts=2, max_samples_per_prompt=3,
        max_new_tokens_limit=8,
    )  # fmt: skip

    def decode(request: pb.MakeExperienceRequest):
        return decode_experience_request(
            request, models=tiny_models, rewards=RewardRegistry(), defaults=limits
        )

    spec = decode(make_request(rows=2, max_new_tokens=8, samples_per_prompt=3))
    assert (len(spec.prompts), spec.samples_per_prompt, spec.sampling.max_new_tokens) == (2, 3, 8)
    # An empty text would be refused by the tokenizing step: the count is refused first.
    texts = pb.MakeExperienceRequest(texts=pb.TextPrompts(texts=["a", "b", ""]))
    with pytest.raises(InvalidArgument, match=r"^prompts: 3 is over .* \(--max-prompts\)"):
        decode(texts)
    with pytest.raises(InvalidArgument, match=r"^samples_per_prompt: 4 is over"):
        decode(make_request(rows=1, samples_per_prompt=4))
    with pytest.raises(InvalidArgument, match=r"^sampling.max_new_tokens: 9 is over"):
        decode(make_request(rows=1, max_new_tokens=9))


# ---- graceful drain: a process of its own ------------------------------------------------------


def test_sigterm_during_a_long_request_lets_it_finish_then_exits_0() -> None:
    proc, port = start_server_process(
        "--device", "cpu", "--shutdown-grace-s", "120", "--drain-delay-s", "1",
        "--metrics-port", "0",
    )  # fmt: skip
    target = f"127.0.0.1:{port}"
    try:
        with grpc.insecure_channel(target) as channel:
            stub = rollout_pb2_grpc.RolloutStub(channel)
            stream = stub.MakeExperience(make_request(rows=6, max_new_tokens=16), timeout=300)
            replies = [next(stream)]
            proc.send_signal(signal.SIGTERM)
            with grpc.insecure_channel(target) as probe_channel:
                health = health_pb2_grpc.HealthStub(probe_channel)

                def not_serving() -> bool:
                    status = health.Check(health_pb2.HealthCheckRequest(), timeout=WAIT_S).status
                    return status == health_pb2.HealthCheckResponse.NOT_SERVING

                wait_for(not_serving, "NOT_SERVING after SIGTERM")
            replies += list(stream)  # every micro-batch still arrives
        assert [r.micro_batch_index for r in replies] == list(range(6))
        assert all(r.num_micro_batches == 6 for r in replies)
        assert proc.wait(timeout=WAIT_S) == 0
    finally:
        proc.terminate_and_wait()
    log = proc.log_text()
    assert "SIGTERM" in log and "Traceback" not in log, log
    assert "rpc method=rollserve.v1.Rollout/MakeExperience status=OK" in log


# ---- deep readiness (in-process) ---------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_models():
    from rollserve.server.config import ServerConfig
    from rollserve.server.models import load_models

    return load_models(ServerConfig(device="cpu"))


def _config(**overrides):
    from rollserve.server.config import ServerConfig

    return ServerConfig(
        **{"host": "127.0.0.1", "port": 0, "device": "cpu", "metrics_port": 0, **overrides}
    )


def _health(target: str) -> int:
    with grpc.insecure_channel(target) as channel:
        request = health_pb2.HealthCheckRequest(service="rollserve.v1.Rollout")
        return health_pb2_grpc.HealthStub(channel).Check(request, timeout=WAIT_S).status


def _norm_update(version: int, fill: float) -> list[pb.UpdateWeightsRequest]:
    data = safetensors.torch.save({"model.norm.weight": torch.full((64,), fill)})
    header = pb.WeightsHeader(
        target=pb.MODEL_ROLE_ACTOR,
        version=version,
        mode=pb.UPDATE_MODE_PARTIAL,
        total_bytes=len(data),
        allow_non_finite=True,
    )
    return [
        pb.UpdateWeightsRequest(header=header),
        pb.UpdateWeightsRequest(chunk=pb.WeightsChunk(offset=0, data=data)),
    ]


def test_a_model_that_fails_its_forward_pass_never_serves(tiny_models) -> None:
    from rollserve.server.engine.readiness import ReadinessError
    from rollserve.server.serving.app import RolloutServer

    broken = copy.deepcopy(tiny_models.actor.module)
    broken.model.norm.weight.fill_(float("nan"))
    models = dataclasses.replace(
        tiny_models, actor=dataclasses.replace(tiny_models.actor, module=broken)
    )
    server = RolloutServer(_config(), models=models)
    port = server.bind()
    try:
        with pytest.raises(ReadinessError, match="actor model produced non-finite outputs"):
            server.load()
        assert _health(f"127.0.0.1:{port}") == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        server.stop(0)


def test_weights_that_fail_the_probe_stop_serving_until_good_ones_arrive(tiny_models) -> None:
    from rollserve.server.serving.app import RolloutServer

    serving = health_pb2.HealthCheckResponse.SERVING
    original = tiny_models.actor.module.model.norm.weight.clone()
    with RolloutServer(_config(), models=tiny_models) as server:
        target = server.address
        assert _health(target) == serving
        with grpc.insecure_channel(target) as channel:
            stub = rollout_pb2_grpc.RolloutStub(channel)
            stub.UpdateWeights(iter(_norm_update(1, float("nan"))), timeout=WAIT_S)
            # At once, without waiting for the verdict: the probe runs on the engine right
            # after the swap, so this job, queued behind it, sees its verdict.
            with pytest.raises(grpc.RpcError) as info:
                list(stub.MakeExperience(make_request(rows=1), timeout=WAIT_S))
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            wait_for(lambda: _health(target) != serving, "NOT_SERVING after NaN weights")
            status = stub.Health(pb.HealthRequest(), timeout=WAIT_S).status
            assert status == pb.SERVING_STATUS_WAITING_FOR_WEIGHTS
            stub.UpdateWeights(iter(_norm_update(2, 1.0)), timeout=WAIT_S)
            wait_for(lambda: _health(target) == serving, "SERVING after good weights")
            assert len(list(stub.MakeExperience(make_request(rows=1), timeout=WAIT_S))) == 1
    with torch.no_grad():
        tiny_models.actor.module.model.norm.weight.copy_(original)
