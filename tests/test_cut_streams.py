"""Cut and stalled UpdateWeights streams against a real server process: nothing applied, RSS back.

One `rollserve serve` subprocess with a ~60 MB actor and `--update-idle-timeout-s 1`. Each test
breaks an upload (cancelled after the header, after a chunk that ends inside a tensor, before the
last chunk; the uploading process SIGKILLed; a client that stops sending and idles) and then
checks: greedy log-probs and policy version unchanged, the server's RSS back to where it was
after a warm-up update (the staging arena is kept warm on purpose, so that is the baseline), and
the next update succeeds. tests/test_update_weights_rpc.py covers the same cuts in-process
without memory; this adds the process, the kill, the idle deadline and the RSS.

Each cut comes once the client has sent the messages before it (its request iterator was asked
for the next one); how many of them the server has read by then is up to the machine, and the
outcome must not depend on it: nothing applied, memory back.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from helpers_server import ServerProcess, greedy_snapshot, rss_bytes, start_server_process
from rollserve.client.client import RolloutClient
from rollserve.client.protocol.wire import update_weights_callable
from rollserve.client.weights.update_file import update_weights_messages
from rollserve.server.config import ServerConfig
from rollserve.server.models import load_models
from rollserve.server.models.default_model import TinyModelSpec, save_tiny_causal_lm

SPEC = TinyModelSpec(hidden_size=512, intermediate_size=4096)  # ~15M parameters, ~60 MB fp32
CHUNK_BYTES = 1 << 20
IDLE_S = 1.0
WAIT_S = 30.0  # bound on every wait; never reached when things work
RSS_SLACK_BYTES = 24 << 20  # well under one staging copy of the model (~60 MB)


@pytest.fixture(scope="module")
def actor_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_causal_lm(tmp_path_factory.mktemp("cut-actor"), SPEC)


@pytest.fixture(scope="module")
def weights(actor_dir: Path) -> dict[str, torch.Tensor]:
    module = load_models(ServerConfig(device="cpu", actor=str(actor_dir))).actor.module
    return {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}


@pytest.fixture(scope="module")
def server(actor_dir: Path, weights) -> Iterator[tuple[ServerProcess, str]]:
    proc, port = start_server_process(
        "--actor",
        str(actor_dir),
        "--device",
        "cpu",
        "--metrics-port",
        "0",
        "--update-idle-timeout-s",
        str(IDLE_S),
    )
    target = f"127.0.0.1:{port}"
    try:
        # Warm-up: RSS reaches its steady state on the second update (measured: the first one's
        # staging arena replaces pages of the loaded checkpoint) and a first experience call.
        # Every update here goes over gRPC: over shared memory the server would also keep the
        # client's memfd mapped for a while (weights/shared_memory.py), which RSS counts.
        with RolloutClient(target, timeout_s=WAIT_S) as client:
            client.update_weights(weights, version=1, chunk_bytes=CHUNK_BYTES, transport="grpc")
            client.update_weights(weights, version=2, chunk_bytes=CHUNK_BYTES, transport="grpc")
        greedy_snapshot(target)
        yield proc, target
    finally:
        assert proc.terminate_and_wait() == 0


def messages(weights, version: int) -> list[bytes]:
    return list(
        update_weights_messages(
            weights, target="actor", version=version, mode="full", chunk_bytes=CHUNK_BYTES
        )
    )


def perturbed(weights: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {n: t + 0.01 * torch.randn(t.shape, generator=generator) for n, t in weights.items()}


class Stalling:
    """Yields messages[:stop_at], signals `reached`, then idles until `release` (bounded)."""

    def __init__(self, encoded: list[bytes], stop_at: int) -> None:
        self.encoded = encoded
        self.stop_at = stop_at
        self.reached = threading.Event()
        self.release = threading.Event()

    def __iter__(self) -> Iterator[bytes]:
        yield from self.encoded[: self.stop_at]
        self.reached.set()
        self.release.wait(WAIT_S)


class Countdown:
    """An event set once `count()` has been called `remaining` times (from any thread)."""

    def __init__(self, remaining: int) -> None:
        self._remaining = remaining
        self._lock = threading.Lock()
        self._done = threading.Event()

    def count(self) -> None:
        with self._lock:
            self._remaining -= 1
            if self._remaining <= 0:
                self._done.set()

    def wait(self, timeout_s: float) -> bool:
        return self._done.wait(timeout_s)


def settled_rss(pid: int, ceiling: int) -> int:
    """The RSS once it is at or under `ceiling`, or after a few seconds of trying."""
    deadline_s = time.monotonic() + 5.0
    while (rss := rss_bytes(pid)) > ceiling and time.monotonic() < deadline_s:
        time.sleep(0.1)
    return rss


def assert_unchanged_then_next_update_succeeds(
    proc: ServerProcess, target: str, before, baseline_rss: int, weights
) -> None:
    assert greedy_snapshot(target) == before
    rss = settled_rss(proc.pid, baseline_rss + RSS_SLACK_BYTES)
    assert rss <= baseline_rss + RSS_SLACK_BYTES, (rss - baseline_rss) / 2**20
    with RolloutClient(target, timeout_s=WAIT_S) as client:
        result = client.update_weights(
            weights, version=before[1] + 1, chunk_bytes=CHUNK_BYTES, transport="grpc"
        )
    assert result.version == before[1] + 1
    # Regression: every cut upload logged "Exception serializing message!" with a traceback.
    log = proc.log_text()
    assert "Traceback" not in log and "Exception serializing" not in log, log[-2000:]


# Where the stream is cut: after the header, after the first chunk (which ends inside a tensor:
# the embedding alone is bigger than a chunk), before the last chunk.
CUTS = {"after_header": 1, "mid_tensor": 2, "before_last_chunk": -1}


@pytest.mark.parametrize("cut", CUTS)
def test_a_cancelled_upload_leaves_weights_version_and_memory(server, weights, cut: str) -> None:
    proc, target = server
    before = greedy_snapshot(target)
    baseline_rss = rss_bytes(proc.pid)
    encoded = messages(perturbed(weights, seed=len(cut)), version=before[1] + 1)
    stalling = Stalling(encoded, CUTS[cut] % len(encoded))
    with grpc.insecure_channel(target) as channel:
        future = update_weights_callable(channel).future(iter(stalling), timeout=WAIT_S)
        try:
            assert stalling.reached.wait(WAIT_S)
            assert future.cancel()
        finally:
            stalling.release.set()
        assert future.code() is grpc.StatusCode.CANCELLED
    assert_unchanged_then_next_update_succeeds(proc, target, before, baseline_rss, weights)


def test_a_stalled_upload_is_ended_by_the_idle_deadline(server, weights) -> None:
    # Regression: with no idle deadline the stalled stream held the update lock forever, so the
    # second update below never finished (and the stalled client, with no deadline, hung too).
    proc, target = server
    before = greedy_snapshot(target)
    baseline_rss = rss_bytes(proc.pid)
    encoded = messages(perturbed(weights, seed=3), version=before[1] + 1)
    stalling = Stalling(encoded, len(encoded) // 2)
    with grpc.insecure_channel(target) as channel:
        started_s = time.monotonic()
        future = update_weights_callable(channel).future(iter(stalling))  # no client deadline
        try:
            assert stalling.reached.wait(WAIT_S)
            with RolloutClient(target, timeout_s=WAIT_S) as other:
                result = other.update_weights(
                    weights, version=before[1] + 1, chunk_bytes=CHUNK_BYTES, transport="grpc"
                )
            assert result.version == before[1] + 1
            error = future.exception(timeout=WAIT_S)
        finally:
            stalling.release.set()
            future.cancel()
    assert time.monotonic() - started_s < 10 * IDLE_S + 5
    assert error is not None and error.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    assert "--update-idle-timeout-s" in error.details()
    assert "Nothing was applied" in error.details() or "nothing was applied" in error.details()
    after_second = (before[0], before[1] + 1)  # the second update sent the same weights again
    assert_unchanged_then_next_update_succeeds(proc, target, after_second, baseline_rss, weights)


_UPLOADER = textwrap.dedent(
    """
    import sys, time, pathlib
    import grpc
    from safetensors.torch import load_file
    from rollserve.client.weights.update_file import update_weights_messages
    from rollserve.client.protocol.wire import update_weights_callable

    target, weights_file, version, ready = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    encoded = list(update_weights_messages(
        load_file(weights_file), target="actor", version=version, mode="full",
        chunk_bytes=1 << 20))

    def stream():
        yield from encoded[: len(encoded) // 2]
        pathlib.Path(ready).write_text("sent")
        time.sleep(600)  # SIGKILLed here, half way through the file

    with grpc.insecure_channel(target) as channel:
        update_weights_callable(channel)(stream())
    """
)


def test_a_sigkilled_uploader_leaves_weights_version_and_memory(
    server, weights, tmp_path: Path
) -> None:
    from safetensors.torch import save_file

    proc, target = server
    before = greedy_snapshot(target)
    baseline_rss = rss_bytes(proc.pid)
    weights_file = tmp_path / "new.safetensors"
    save_file({n: t.contiguous() for n, t in perturbed(weights, seed=5).items()}, weights_file)
    ready = tmp_path / "ready"
    uploader = subprocess.Popen(
        [sys.executable, "-c", _UPLOADER, target, str(weights_file), str(before[1] + 1), str(ready)]
    )
    try:
        deadline_s = time.monotonic() + WAIT_S
        while not ready.exists() and uploader.poll() is None and time.monotonic() < deadline_s:
            time.sleep(0.05)
        assert ready.exists(), "the uploader never got half way"
        uploader.kill()  # SIGKILL: no goodbye on the connection beyond what the kernel sends
    finally:
        uploader.kill()
        uploader.wait()
    assert uploader.returncode == -9
    assert_unchanged_then_next_update_succeeds(proc, target, before, baseline_rss, weights)


def test_many_stalled_uploads_neither_queue_nor_starve_health(server, weights) -> None:
    # Regression: every stream waiting for the update lock held a gRPC handler thread; 16
    # stalled uploads took all 16 (--max-workers) and Health hung until each stall had timed
    # out in turn. Now one streams, one waits, the rest are refused at once.
    proc, target = server
    before = greedy_snapshot(target)
    encoded = messages(weights, version=before[1] + 1)
    stalls = [Stalling(encoded, 1) for _ in range(16)]
    channels = [grpc.insecure_channel(target) for _ in stalls]
    try:
        futures = [
            update_weights_callable(channel).future(iter(stall), timeout=WAIT_S)
            for channel, stall in zip(channels, stalls, strict=True)
        ]
        ended = Countdown(len(futures) - 2)  # all but the one streaming and the one waiting
        for future in futures:
            future.add_done_callback(lambda _: ended.count())
        # Once all but two have ended (refused at once) the server has taken every upload;
        # Health must still answer at once, with two uploads stalled.
        assert ended.wait(WAIT_S), "the server did not end the uploads that cannot proceed"
        with RolloutClient(target, timeout_s=0.6 * IDLE_S) as client:
            assert client.health().policy_version == before[1]
        errors = [future.exception(timeout=WAIT_S) for future in futures]
    finally:
        for stall in stalls:
            stall.release.set()
        for channel in channels:
            channel.close()
    codes = [error.code() if error is not None else grpc.StatusCode.OK for error in errors]
    refused = [
        e for e in errors if e is not None and e.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    ]
    assert len(refused) >= 14, codes
    assert "another is waiting" in refused[0].details()
    assert set(codes) <= {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED}
    assert_unchanged_then_next_update_succeeds(proc, target, before, rss_bytes(proc.pid), weights)
