"""SIGTERM while calls are in flight: each completes or gets a clear status, the process exits 0.

tests/test_limits_and_drain.py proves a MakeExperience that fits the grace period finishes. Here:
an UpdateWeights stream that is mid-file when SIGTERM arrives (it finishes inside the grace
period and is applied whole, or, stalled past the grace period, ends with a status and nothing
applied), and a MakeExperience that outlasts the grace period (it ends with a status, and the
engine thread is joined before exit, so no std::terminate). Every case: exit code 0, a log
without tracebacks, and the client never hangs.

No case depends on the machine's speed: the upload stalls in the test's own request iterator,
and the MakeExperience stalls on the engine thread inside a reward endpoint that the test
serves and holds, until the grace period has ended.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc
import pytest
import torch
from helpers_server import ServerProcess, start_server_process
from rollserve.client.protocol.wire import update_weights_callable
from rollserve.client.weights.update_file import update_weights_messages
from rollserve.server.config import ServerConfig
from rollserve.server.models import load_models
from rollserve.server.serving.cli import check_health
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


def start(actor_dir: Path, *flags: str) -> tuple[ServerProcess, str]:
    proc, port = start_server_process(
        "--actor", str(actor_dir), "--device", "cpu", "--metrics-port", "0",
        "--shutdown-grace-s", str(GRACE_S), *flags,
    )  # fmt: skip
    return proc, f"127.0.0.1:{port}"


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline_s = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline_s, f"still not true after {WAIT_S} s: {what}"
        time.sleep(0.02)


class HeldRewards:
    """A reward endpoint (server/experience/rewards.py's JSON protocol, all rewards 0) that
    answers its first call and holds every later one until `release` (bounded): `held` is set
    once the engine thread waits inside it."""

    def __init__(self) -> None:
        self.held = threading.Event()
        self.release = threading.Event()
        self._answered_first = threading.Event()
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if endpoint._answered_first.is_set():
                    endpoint.held.set()
                    endpoint.release.wait(WAIT_S)
                endpoint._answered_first.set()
                payload = json.dumps({"rewards": [0.0] * len(body["responses"])}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/score"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.release.set()
        self._server.shutdown()
        self._server.server_close()


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
            # The server is stopping once it refuses new calls; the in-flight one continues.
            serving = {"SERVING", "NOT_SERVING"}
            wait_until(lambda: check_health(target, "", timeout_s=1.0) not in serving, "stop")
            gate.release.set()
            response = future.result(timeout=WAIT_S)
        assert (response.version, response.tensors) == (1, len(weights))
        assert_clean_exit(proc)
        assert "rpc method=rollserve.v1.Rollout/UpdateWeights status=OK" in proc.log_text()
    finally:
        proc.terminate_and_wait()


def held_experience_request() -> pb.MakeExperienceRequest:
    """Two generation batches rewarded by the held endpoint: the first is streamed (no
    whitening across the request), the second waits for its rewards."""
    request = pb.MakeExperienceRequest(samples_per_prompt=2)
    request.token_ids.values.extend([1, 5] * 4)
    request.token_ids.lengths.extend([2] * 4)
    request.sampling.max_new_tokens = 8
    request.sampling.seed = 1
    request.algorithm.whitening = "none"
    request.rewards.add(source="held")
    request.batching.micro_batch_size = 2
    request.batching.generate_batch_size = 2
    return request


def test_sigterm_ends_a_stalled_upload_and_a_long_make_experience_with_statuses(
    tiny_actor_dir: Path, weights
) -> None:
    """Both calls outlast the grace period: each ends with a status, nothing is applied."""
    rewards = HeldRewards()
    proc, target = start(
        tiny_actor_dir,
        "--reward-endpoint",
        f"held={rewards.url}",
        "--reward-timeout-s",
        str(WAIT_S),
    )
    try:
        gate = Gate(encoded_update(weights, version=1), at=2, finish=False)
        with grpc.insecure_channel(target) as channel:
            upload = update_weights_callable(channel).future(iter(gate), timeout=WAIT_S)
            stream = channel.unary_stream(
                "/rollserve.v1.Rollout/MakeExperience",
                request_serializer=pb.MakeExperienceRequest.SerializeToString,
                response_deserializer=pb.MakeExperienceResponse.FromString,
            )(held_experience_request(), timeout=WAIT_S)
            try:
                assert next(stream).micro_batch_index == 0  # the first batch is out
                assert rewards.held.wait(WAIT_S)  # the engine waits for the second's rewards
                assert gate.reached.wait(WAIT_S)  # the upload is half way and stalls
                signalled_s = time.monotonic()
                proc.send_signal(signal.SIGTERM)
                with pytest.raises(grpc.RpcError) as info:
                    for _ in stream:
                        pass
                upload_error = upload.exception(timeout=WAIT_S)
            finally:
                gate.release.set()
                rewards.release.set()  # the engine finishes its batch; the server joins it
        assert info.value.code() in CLEAR_STATUSES, info.value
        assert upload_error is not None and upload_error.code() in CLEAR_STATUSES, upload_error
        assert time.monotonic() - signalled_s < GRACE_S + 15
        assert_clean_exit(proc)
        assert "updated actor to version 1" not in proc.log_text()  # nothing was swapped in
    finally:
        proc.terminate_and_wait()
        rewards.close()
