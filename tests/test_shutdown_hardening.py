"""SIGTERM while calls are in flight: each completes or gets a clear status, the process exits 0.

tests/test_limits_and_drain.py proves a MakeExperience that fits the grace period finishes. Here:
an UpdateWeights stream that is mid-file when SIGTERM arrives (it finishes inside the grace
period and is applied whole, or, stalled past the grace period, ends with a status and nothing
applied), and a MakeExperience that outlasts the grace period (it ends with a status, and the
engine thread is joined before exit, so no std::terminate). Every case: exit code 0, a log
without tracebacks, and the client never hangs.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from helpers_server import ServerProcess, start_server_process
from rollserve.client.protocol.wire import update_weights_callable
from rollserve.client.weights.update_file import update_weights_messages
from rollserve.server.config import ServerConfig
from rollserve.server.models import load_models
from rollserve.v1 import rollout_pb2 as pb

WAIT_S = 60.0  # bound on every wait; never reached when things work
GRACE_S = 2.0
CLEAR_STATUSES = {grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE}


@pytest.fixture(scope="module")
def weights(tiny_actor_dir: Path) -> dict[str, torch.Tensor]:
    module = load_models(ServerConfig(device="cpu", actor=str(tiny_actor_dir))).actor.module
    generator = torch.Generator().manual_seed(4)
    return {
        name: tensor.detach() + 0.01 * torch.randn(tensor.shape, generator=generator)
        for name, tensor in module.state_dict().items()
    }


def start(actor_dir: Path) -> tuple[ServerProcess, str]:
    proc, port = start_server_process(
        "--actor", str(actor_dir), "--device", "cpu", "--metrics-port", "0",
        "--shutdown-grace-s", str(GRACE_S),
    )  # fmt: skip
    return proc, f"127.0.0.1:{port}"


class Gate:
    """Yields messages[:at], signals `reached`, waits for `release` (bounded), then the rest
    (or stops, when `finish` is False)."""

    def __init__(self, encoded: list[bytes], at: int, *, finish: bool) -> None:
        self.encoded, self.at, self.finish = encoded, at, finish
        self.reached = threading.Event()
        self.release = threading.Event()

    def __iter__(self) -> Iterator[bytes]:
        yield from self.encoded[: self.at]
        self.reached.set()
        self.release.wait(WAIT_S)
        if self.finish:
            yield from self.encoded[self.at :]


def encoded_update(weights, version: int) -> list[bytes]:
    return list(
        update_weights_messages(
            weights, target="actor", version=version, mode="full", chunk_bytes=256 * 1024
        )
    )


def assert_clean_exit(proc: ServerProcess) -> None:
    assert proc.wait(timeout=WAIT_S) == 0
    log = proc.log_text()
    assert "SIGTERM" in log and "Traceback" not in log, log[-3000:]


def test_sigterm_mid_upload_lets_the_upload_finish_and_apply(tiny_actor_dir: Path, weights) -> None:
    proc, target = start(tiny_actor_dir)
    try:
        gate = Gate(encoded_update(weights, version=1), at=2, finish=True)
        with grpc.insecure_channel(target) as channel:
            future = update_weights_callable(channel).future(iter(gate), timeout=WAIT_S)
            assert gate.reached.wait(WAIT_S)
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)  # the server is stopping: no new calls, in-flight ones continue
            gate.release.set()
            response = future.result(timeout=WAIT_S)
        assert (response.version, response.tensors) == (1, len(weights))
        assert_clean_exit(proc)
        assert "rpc method=rollserve.v1.Rollout/UpdateWeights status=OK" in proc.log_text()
    finally:
        proc.terminate_and_wait()


def long_experience_request() -> pb.MakeExperienceRequest:
    """Many small micro-batches, streamed as they are made (no whitening across the request)."""
    request = pb.MakeExperienceRequest(samples_per_prompt=2)
    request.token_ids.values.extend([1, 5] * 32)
    request.token_ids.lengths.extend([2] * 32)
    request.sampling.max_new_tokens = 64
    request.sampling.ignore_eos = True
    request.sampling.seed = 1
    request.algorithm.whitening = "none"
    request.rewards.add(source="numeric_match")
    request.gt_answers.extend(["1"] * 32)
    request.batching.micro_batch_size = 2
    request.batching.generate_batch_size = 2
    return request


def test_sigterm_ends_a_stalled_upload_and_a_long_make_experience_with_statuses(
    tiny_actor_dir: Path, weights
) -> None:
    """Both calls outlast the grace period: each ends with a status, nothing is applied."""
    proc, target = start(tiny_actor_dir)
    try:
        gate = Gate(encoded_update(weights, version=1), at=2, finish=False)
        with grpc.insecure_channel(target) as channel:
            upload = update_weights_callable(channel).future(iter(gate), timeout=WAIT_S)
            stream = channel.unary_stream(
                "/rollserve.v1.Rollout/MakeExperience",
                request_serializer=pb.MakeExperienceRequest.SerializeToString,
                response_deserializer=pb.MakeExperienceResponse.FromString,
            )(long_experience_request(), timeout=WAIT_S)
            try:
                assert next(stream).micro_batch_index == 0  # the engine is generating
                assert gate.reached.wait(WAIT_S)  # the upload is half way and stalls
                signalled_s = time.monotonic()
                proc.send_signal(signal.SIGTERM)
                with pytest.raises(grpc.RpcError) as info:
                    for _ in stream:
                        pass
                upload_error = upload.exception(timeout=WAIT_S)
            finally:
                gate.release.set()
        assert info.value.code() in CLEAR_STATUSES, info.value
        assert upload_error is not None and upload_error.code() in CLEAR_STATUSES, upload_error
        assert time.monotonic() - signalled_s < GRACE_S + 15
        assert_clean_exit(proc)
        assert "updated actor to version 1" not in proc.log_text()  # nothing was swapped in
    finally:
        proc.terminate_and_wait()
