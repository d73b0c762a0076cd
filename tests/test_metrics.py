"""Prometheus metrics, request ids and the access log, scraped from a real server process.

Each test reads the metrics before and after its own calls and checks the difference against
what the client itself saw (tokens in the streamed experience, bytes of the messages), so tests
do not depend on one another's counts.
"""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
import safetensors.torch
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers_server import ServerProcess, free_port, start_server_process
from prometheus_client.parser import text_string_to_metric_families
from rollserve.client import RolloutClient
from rollserve.client.protocol.codec import decode_tensor
from rollserve.client.weights.distributed import WeightsGroup
from rollserve.v1 import rollout_pb2 as pb
from rollserve.v1 import rollout_pb2_grpc

WAIT_S = 60.0
MAKE = {"service": "rollserve.v1.Rollout", "method": "MakeExperience"}
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[ServerProcess, str, int]]:
    metrics_port = free_port()
    proc, port = start_server_process(
        "--device", "cpu", "--metrics-port", str(metrics_port), "--max-prompts", "4"
    )
    yield proc, f"127.0.0.1:{port}", metrics_port
    assert proc.terminate_and_wait() == 0, proc.log_text()


@pytest.fixture
def stub(server) -> Iterator[rollout_pb2_grpc.RolloutStub]:
    with grpc.insecure_channel(server[1]) as channel:
        yield rollout_pb2_grpc.RolloutStub(channel)


def scrape(metrics_port: int) -> Samples:
    """Every sample of the /metrics page, keyed by (name, labels)."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=WAIT_S) as reply:
        text = reply.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def request(rows: int = 2, **fields) -> pb.MakeExperienceRequest:
    return pb.MakeExperienceRequest(
        token_ids=pb.RaggedTokenIds(values=[5, 6, 7] * rows, lengths=[3] * rows),
        sampling=pb.SamplingOptions(max_new_tokens=6, seed=3),
        rewards=[pb.RewardTerm(source="exact_match")],
        gt_answers=["x"] * rows,
        batching=pb.BatchingOptions(micro_batch_size=1),
        algorithm=pb.AlgorithmOptions(whitening="none"),
        **fields,
    )


def test_make_experience_moves_the_counters(server, stub) -> None:
    _, _, metrics_port = server
    before = scrape(metrics_port)
    responses = list(stub.MakeExperience(request(rows=3), timeout=WAIT_S))
    after = scrape(metrics_port)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    tokens = sum(int(decode_tensor(r.experience.info["response_length"]).sum()) for r in responses)
    assert len(responses) == 3 and tokens > 0
    assert delta("rollserve_generated_tokens_total") == tokens
    assert delta("rollserve_rpc_handled_total", **MAKE, code="OK") == 1
    assert delta("rollserve_rpc_duration_seconds_count", **MAKE, code="OK") == 1
    assert delta("rollserve_micro_batch_rows_count") == 3
    assert delta("rollserve_micro_batch_rows_sum") == 3
    assert delta("rollserve_request_rows_count") == 1
    assert delta("rollserve_request_rows_sum") == 3
    sent = sum(r.ByteSize() for r in responses)
    assert delta("rollserve_rpc_sent_bytes_total", **MAKE) == sent
    assert delta("rollserve_rpc_received_bytes_total", **MAKE) == request(rows=3).ByteSize()
    assert value(after, "rollserve_rpc_in_flight", **MAKE) == 0
    assert value(after, "rollserve_queue_depth") == 0
    assert value(after, "rollserve_phase", phase="serving") == 1
    assert value(after, "rollserve_phase", phase="loading") == 0
    assert value(after, "rollserve_uptime_seconds") > 0
    # A CPU server has no device allocator to report.
    assert not any(name == "rollserve_device_memory_bytes" for name, _ in after)


def test_refused_requests_are_counted_by_code(server, stub) -> None:
    _, _, metrics_port = server
    before = scrape(metrics_port)
    with pytest.raises(grpc.RpcError) as info:
        list(stub.MakeExperience(pb.MakeExperienceRequest(), timeout=WAIT_S))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as info:  # over --max-prompts 4
        list(stub.MakeExperience(request(rows=5), timeout=WAIT_S))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompts: 5 is over this server's limit of 4" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        stub.UpdateWeights(iter([pb.UpdateWeightsRequest()]), timeout=WAIT_S)
    after = scrape(metrics_port)
    rejected = "rollserve_rpc_rejected_total"
    assert (
        value(after, rejected, **MAKE, code="INVALID_ARGUMENT")
        - value(before, rejected, **MAKE, code="INVALID_ARGUMENT")
        == 2
    )
    update = {"service": "rollserve.v1.Rollout", "method": "UpdateWeights"}
    assert (
        value(after, rejected, **update, code=info.value.code().name)
        == value(before, rejected, **update, code=info.value.code().name) + 1
    )
    assert value(after, "rollserve_rpc_handled_total", **MAKE, code="OK") == value(
        before, "rollserve_rpc_handled_total", **MAKE, code="OK"
    )


def test_weight_update_metrics_and_policy_version(server, stub) -> None:
    _, _, metrics_port = server
    before = scrape(metrics_port)
    version = int(value(before, "rollserve_policy_version", role="actor")) + 1
    data = safetensors.torch.save({"model.norm.weight": torch.full((64,), 0.5 + version)})
    header = pb.WeightsHeader(
        target=pb.MODEL_ROLE_ACTOR,
        version=version,
        mode=pb.UPDATE_MODE_PARTIAL,
        total_bytes=len(data),
    )
    messages = [
        pb.UpdateWeightsRequest(header=header),
        pb.UpdateWeightsRequest(chunk=pb.WeightsChunk(offset=0, data=data)),
    ]
    response = stub.UpdateWeights(iter(messages), timeout=WAIT_S)
    after = scrape(metrics_port)
    actor = {"role": "actor"}
    assert value(after, "rollserve_policy_version", **actor) == version
    assert value(after, "rollserve_policy_version", role="reference") == 0
    assert response.transport == "grpc"
    by_transport = {"role": "actor", "transport": "grpc"}
    updates = value(after, "rollserve_weight_updates_total", **by_transport)
    assert updates - value(before, "rollserve_weight_updates_total", **by_transport) == 1
    bytes_delta = value(after, "rollserve_weight_update_bytes_total", **actor) - value(
        before, "rollserve_weight_update_bytes_total", **actor
    )
    assert bytes_delta == response.bytes == len(data)
    duration = "rollserve_weight_update_duration_seconds_sum"
    assert value(after, duration, **actor) - value(before, duration, **actor) == pytest.approx(
        response.seconds
    )
    gbps = value(after, "rollserve_weight_update_gigabytes_per_second", **by_transport)
    assert gbps == pytest.approx(response.bytes / response.seconds / 1e9)
    update = {"service": "rollserve.v1.Rollout", "method": "UpdateWeights"}

    def delta(name: str) -> float:
        return value(after, name, **update) - value(before, name, **update)

    assert delta("rollserve_rpc_received_bytes_total") == sum(m.ByteSize() for m in messages)
    assert delta("rollserve_rpc_sent_bytes_total") == response.ByteSize() > 0


def test_a_group_update_sends_its_header_and_head_as_one_unary_call(server) -> None:
    """A WeightsGroup update's call carries only the header and the file's head: the client
    sends it as one UpdateWeightsAtOnce (after one empty probe, answered INVALID_ARGUMENT), and
    never opens an UpdateWeights stream for it."""
    _, target, metrics_port = server
    before = scrape(metrics_port)
    version = int(value(before, "rollserve_policy_version", role="actor")) + 1
    norm = {"model.norm.weight": torch.full((64,), 0.25 + version)}
    with RolloutClient(target, timeout_s=WAIT_S) as client:
        with WeightsGroup([client], timeout_s=WAIT_S) as group:
            for step in range(2):
                result = client.update_weights(
                    norm, version=version + step, mode="partial", group=group
                )
                assert (result.transport, result.version) == ("dist", version + step)
    after = scrape(metrics_port)

    def calls(method: str, code: str) -> float:
        labels = {"service": "rollserve.v1.Rollout", "method": method, "code": code}
        name = "rollserve_rpc_handled_total"
        return value(after, name, **labels) - value(before, name, **labels)

    assert calls("UpdateWeightsAtOnce", "OK") == 2
    assert calls("UpdateWeightsAtOnce", "INVALID_ARGUMENT") == 1  # the probe, once per client
    assert calls("UpdateWeights", "OK") == 0


def test_request_ids_are_echoed_and_logged(server, stub) -> None:
    proc, _, _ = server
    stream = stub.MakeExperience(
        request(rows=1), metadata=(("x-request-id", "trainer-step-17"),), timeout=WAIT_S
    )
    assert ("x-request-id", "trainer-step-17") in stream.initial_metadata()
    list(stream)
    assert ("x-request-id", "trainer-step-17") in stream.trailing_metadata()
    # Without metadata: the request's own request_id field; without either, a fresh one.
    stream = stub.MakeExperience(request(rows=1, request_id="field-id-3"), timeout=WAIT_S)
    list(stream)
    assert ("x-request-id", "field-id-3") in stream.trailing_metadata()
    _, call = stub.Health.with_call(pb.HealthRequest(), timeout=WAIT_S)
    generated = dict(call.trailing_metadata())["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", generated)
    # Ids with spaces are kept (and quoted in the log).
    list(
        stub.MakeExperience(request(rows=1), metadata=(("x-request-id", "step 9"),), timeout=WAIT_S)
    )
    # Refused calls carry an id too, and unusable ids are replaced rather than echoed.
    with pytest.raises(grpc.RpcError) as info:
        list(
            stub.MakeExperience(
                pb.MakeExperienceRequest(),
                metadata=(("x-request-id", "x" * 129),),  # too long to log
                timeout=WAIT_S,
            )
        )
    replaced = dict(info.value.trailing_metadata())["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", replaced)

    pattern = (
        r"rpc method=rollserve\.v1\.Rollout/MakeExperience status=OK duration_ms=[0-9.]+ "
        r"peer=\S+ request_id=trainer-step-17 request_bytes=\d+ response_bytes=\d+ responses=1"
    )
    deadline_s = time.monotonic() + WAIT_S  # the log line is written after the last message
    while not re.search(pattern, proc.log_text()):
        assert time.monotonic() < deadline_s, proc.log_text()
        time.sleep(0.05)
    log = proc.log_text()
    assert f"request_id={generated}" in log and "request_id=field-id-3" in log
    assert 'request_id="step 9"' in log
    assert re.search(rf"status=INVALID_ARGUMENT .*request_id={replaced}.* details=", log)


def test_standard_health_checks_are_not_logged_at_info(server) -> None:
    proc, target, _ = server
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for _ in range(3):
            stub.Check(health_pb2.HealthCheckRequest(), timeout=WAIT_S)
    assert "grpc.health.v1.Health/Check" not in proc.log_text()


# ---- in-process: one registry per server --------------------------------------------------------


def test_each_server_has_its_own_registry_and_a_busy_metrics_port_is_not_fatal(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from rollserve.server.config import ServerConfig
    from rollserve.server.models import load_models
    from rollserve.server.serving.app import RolloutServer

    metrics_port = free_port()
    config = ServerConfig(host="127.0.0.1", port=0, device="cpu", metrics_port=metrics_port)
    models = load_models(config)
    with (
        RolloutServer(config, models=models) as first,
        RolloutServer(config, models=models) as second,
    ):
        assert first.metrics_port == metrics_port
        assert second.metrics_port is None  # could not bind: serving goes on without it
        assert "metrics endpoint off" in caplog.text
        with grpc.insecure_channel(second.address) as channel:
            rollout_pb2_grpc.RolloutStub(channel).Health(pb.HealthRequest(), timeout=WAIT_S)
        labels = {**{"service": "rollserve.v1.Rollout", "method": "Health"}, "code": "OK"}
        name = "rollserve_rpc_handled_total"
        assert second.metrics.registry.get_sample_value(name, labels) == 1
        assert first.metrics.registry.get_sample_value(name, labels) is None
        assert value(scrape(metrics_port), name, **labels) == 0
    # Stopping the server frees the metrics port.
    with RolloutServer(config, models=models) as third:
        assert third.metrics_port == metrics_port


@pytest.mark.gpu
def test_device_memory_of_a_cuda_server_is_exported_by_kind(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from rollserve.server.config import ServerConfig
    from rollserve.server.models import load_models
    from rollserve.server.serving.app import RolloutServer

    monkeypatch.setenv("ROLLSERVE_ENGINE_COMPILE", "0")  # the engine uncompiled: a short test
    config = ServerConfig(host="127.0.0.1", port=0, device="cuda", metrics_port=free_port())
    with RolloutServer(config, models=load_models(config)) as served:
        with grpc.insecure_channel(served.address) as channel:
            list(rollout_pb2_grpc.RolloutStub(channel).MakeExperience(request(), timeout=WAIT_S))
        samples = scrape(served.metrics_port)
    memory = {
        kind: value(samples, "rollserve_device_memory_bytes", kind=kind)
        for kind in ("allocated", "reserved", "peak_allocated", "peak_reserved")
    }
    actor = served.runtime.maker.models.actor.module
    weights = sum(p.numel() * p.element_size() for p in actor.parameters())
    assert memory["allocated"] >= weights, memory
    assert memory["reserved"] >= memory["allocated"], memory
    assert memory["peak_allocated"] >= memory["allocated"], memory
    assert memory["peak_reserved"] >= max(memory["reserved"], memory["peak_allocated"]), memory
