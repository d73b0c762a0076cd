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

import functools
import json
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc
import pytest
import torch
from helpers_server import ServerProcess, free_port, start_server_process
from helpers_wait import wait_until as wait_until_within
from rollserve.client.protocol.wire import update_weights_callable
from rollserve.client.weights.update_file import update_weights_messages
from rollserve.server.config import ServerConfig
from rollserve.server.models import load_models
from rollserve.server.serving.cli import check_health
from rollserve.server.serving.exit_codes import STOP_BOUND_S, ExitCode
from rollserve.v1 import rollout_pb2 as pb
from rollserve.v1 import rollout_pb2_grpc

WAIT_S = 60.0  # bound on every wait; never reached when things work
wait_until = functools.partial(wait_until_within, within_s=WAIT_S)
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


def assert_clean_exit(proc: ServerProcess, code: ExitCode = ExitCode.DRAINED) -> None:
    assert proc.wait(timeout=WAIT_S) == code, proc.log_text()[-3000:]
    log = proc.log_text()
    assert "SIGTERM" in log and "Traceback" not in log, log[-3000:]


def test_sigterm_mid_upload_lets_the_upload_finish_and_apply(tiny_actor_dir: Path, weights) -> None:
    # A grace the rest of the upload fits in on a loaded machine (with 2 s, two busy cores made
    # it outlast the grace now and then: cancelled, UNAVAILABLE); it ends as soon as it is done.
    proc, target = start(tiny_actor_dir, "--shutdown-grace-s", "30")
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
        # Both outlasted the grace: cancelled, then every handler and the engine stopped.
        assert_clean_exit(proc, ExitCode.CANCELLED)
        assert "updated actor to version 1" not in proc.log_text()  # nothing was swapped in
    finally:
        proc.terminate_and_wait()
        rewards.close()


# ---- issue 22, item 5: SIGTERM ends the process within the grace plus a bound, whatever runs ----

# A channel that takes little before its reader reads: no BDP probing, a small lookahead.
SMALL_WINDOWS = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 16384)]
WAITING_PARTS = 8  # server/weights/parallel.py: MAX_WAITING_PARTS
SHORT_GRACE_S = 0.5


def bulky_request(rows: int) -> pb.MakeExperienceRequest:
    """One micro-batch of `rows` rows x 32 new tokens: far more than a small window holds."""
    request = pb.MakeExperienceRequest()
    request.token_ids.values.extend([5, 6, 7] * rows)
    request.token_ids.lengths.extend([3] * rows)
    request.sampling.max_new_tokens = 32
    request.sampling.seed = 5
    request.sampling.ignore_eos = True
    request.batching.micro_batch_size = rows
    request.batching.generate_batch_size = rows
    request.rewards.add(source="exact_match")
    request.gt_answers.extend(["x"] * rows)
    return request


def micro_batches_sent(metrics_port: int) -> float:
    """Micro-batches the server's handlers handed to gRPC (its Prometheus endpoint)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    for line in text.splitlines():
        if line.startswith("rollserve_micro_batch_rows_count"):
            return float(line.split()[-1])
    return 0.0


def waiting_part(update_id: str, release: threading.Event) -> Iterator[pb.UpdateWeightsRequest]:
    """Part 1 of an update whose part 0 never comes; the stream stays open until `release`."""
    header = pb.WeightsHeader(target=pb.MODEL_ROLE_ACTOR, version=1, total_bytes=1000)
    header.parallel.update_id = update_id
    header.parallel.streams, header.parallel.index = 2, 1
    header.parallel.begin, header.parallel.end = 500, 1000
    yield pb.UpdateWeightsRequest(header=header)
    release.wait(WAIT_S)


def test_sigterm_cancels_stuck_sends_and_parts_waiting_on_a_peer_then_exits_3(
    tiny_actor_dir: Path,
) -> None:
    metrics_port = free_port()
    proc, target = start(
        tiny_actor_dir, "--metrics-port", str(metrics_port), "--stream-send-timeout-s", "600",
        "--parallel-part-wait-s", "600", "--shutdown-grace-s", str(SHORT_GRACE_S),
    )  # fmt: skip
    release = threading.Event()
    try:
        with (
            grpc.insecure_channel(target, options=SMALL_WINDOWS) as stuck,
            grpc.insecure_channel(target) as channel,
        ):
            stub = rollout_pb2_grpc.RolloutStub(channel)
            # A reader that never reads: its handler blocks sending the one micro-batch.
            never_read = rollout_pb2_grpc.RolloutStub(stuck).MakeExperience(
                bulky_request(128), timeout=WAIT_S
            )
            wait_until(lambda: micro_batches_sent(metrics_port) >= 1, "the handler sends")
            # Parts waiting for a part 0 that never comes: one more than the pool holds, so
            # once one is refused, the others wait.
            parts = [
                stub.UpdateWeights.future(waiting_part(f"ghost-{i}", release), timeout=WAIT_S)
                for i in range(WAITING_PARTS + 1)
            ]
            wait_until(lambda: any(part.done() for part in parts), "one part is refused")
            (refused,) = [part for part in parts if part.done()]
            assert refused.exception().code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            parts.remove(refused)
            signalled_s = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=WAIT_S)
            took_s = time.monotonic() - signalled_s
            for part in parts:
                assert part.exception(timeout=WAIT_S).code() in CLEAR_STATUSES
            with pytest.raises(grpc.RpcError) as info:
                list(never_read)
            assert info.value.code() in CLEAR_STATUSES, info.value
        assert code == ExitCode.CANCELLED, proc.log_text()[-3000:]
        # Within the grace and the bound: neither the send deadline nor the parts' wait.
        assert took_s < SHORT_GRACE_S + STOP_BOUND_S, took_s
        log = proc.log_text()
        assert "cancelled" in log and "Traceback" not in log, log[-3000:]
    finally:
        release.set()
        proc.terminate_and_wait()


def test_sigterm_leaves_a_batch_stuck_on_the_engine_behind_and_exits_4(
    tiny_actor_dir: Path,
) -> None:
    """The engine waits inside a reward endpoint that never answers: the process leaves it
    behind STOP_BOUND_S after the grace, and says so with its exit code."""
    rewards = HeldRewards()
    proc, target = start(
        tiny_actor_dir, "--reward-endpoint", f"held={rewards.url}", "--reward-timeout-s", "600",
        "--shutdown-grace-s", str(SHORT_GRACE_S),
    )  # fmt: skip
    try:
        with grpc.insecure_channel(target) as channel:
            stream = rollout_pb2_grpc.RolloutStub(channel).MakeExperience(
                held_experience_request(), timeout=WAIT_S
            )
            assert next(stream).micro_batch_index == 0
            assert rewards.held.wait(WAIT_S)  # the engine waits for the second batch's rewards
            signalled_s = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=WAIT_S)
            took_s = time.monotonic() - signalled_s
            with pytest.raises(grpc.RpcError) as info:
                list(stream)
            assert info.value.code() in CLEAR_STATUSES, info.value
        assert code == ExitCode.ABANDONED, proc.log_text()[-3000:]
        assert SHORT_GRACE_S + STOP_BOUND_S * 0.9 < took_s < SHORT_GRACE_S + STOP_BOUND_S + 3.0
        assert "leaving behind" in proc.log_text()
    finally:
        proc.terminate_and_wait()
        rewards.close()


def test_the_exit_watchdog_leaves_a_process_that_something_holds() -> None:
    # What serve() arms at the signal: a non-daemon thread that never ends would hold the
    # interpreter's exit for ever; the watchdog ends the process with ABANDONED.
    code = (
        "import threading\n"
        "from rollserve.server.serving.app import _exit_after\n"
        "threading.Thread(target=threading.Event().wait).start()\n"
        "_exit_after(0.2)\n"
    )
    started_s = time.monotonic()
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=WAIT_S)
    assert result.returncode == ExitCode.ABANDONED, result.stderr.decode()[-2000:]
    assert time.monotonic() - started_s < WAIT_S / 2


def test_serve_help_lists_the_exit_codes() -> None:
    command = [sys.executable, "-m", "rollserve.server", "serve", "--help"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=WAIT_S)
    assert result.returncode == 0, result.stderr
    assert "--shutdown-grace-s" in result.stdout and "exit codes:" in result.stdout
    for code in ExitCode:
        assert f"\n  {int(code)}  " in result.stdout, result.stdout[-1500:]
