"""Hardening, second round: limits a hostile admin-token caller used to walk around.

One in-process server on 127.0.0.1:0 with both tokens serves the tiny model (64x64 attention
projections). Checked, each bounded in time:

* LoRA rank: an adapter whose rank is above min(in, out) of a module is refused when its head
  is parsed (INVALID_ARGUMENT), before the staging arena is allocated: rank 2**28 claims 137 GB,
  rank 2**19 268 MB, and the server's RSS does not grow by either; the old weights keep serving
  and a valid adapter still merges.
* Shared memory: a FIFO or a socket sent as SharedMemorySource{pid, fd} is refused at once,
  without opening it (a blocking open of a FIFO used to hold the update lock until something
  wrote to it); the next update succeeds.
* InitWeightsGroup: timeout_s=3600 toward a closed port is capped by --max-group-timeout-s, the
  call ends soon after the cap, at most MAX_JOINING run at once, and Health and grpc.health.v1
  answer meanwhile; a caller that cancels frees its join at once; SIGTERM ends a server process
  whose rendezvous is stuck inside c10d within its grace.
* WeightsGroup: one formed against a server process started a moment ago (not yet listening,
  then loading) waits for it and works; one that a server refuses fails at once (well under the
  store's timeout), frees its store's port and join thread, and the next attempt works.
* Readers that never read: --max-workers MakeExperience streams whose client never reads (small
  flow-control windows) hold every call slot; Health and grpc.health.v1 still answer within 1 s,
  one more call is RESOURCE_EXHAUSTED at once, and after --stream-send-timeout-s each stream
  ends DEADLINE_EXCEEDED and its slot is free again.
* A Subscribe client that never reads, first in the ring, no longer stops the continuous rollout:
  the other subscriber gets its batches well before the stuck one's send deadline, which then
  ends the stuck subscription.
* Parallel parts: 16 part-1 headers of updates whose part 0 never comes hold at most
  MAX_WAITING_PARTS handler threads (the rest are RESOURCE_EXHAUSTED at once); the probes answer
  and a normal update succeeds meanwhile.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers_server import ServerProcess, free_port, rss_bytes, start_server_process
from helpers_wait import became_true
from helpers_weights import state_hash, update_weights_requests
from rollserve.client import RolloutClient
from rollserve.client.protocol.errors import ResourceExhausted, RolloutError
from rollserve.client.protocol.wire import update_weights_callable
from rollserve.client.weights.distributed import WeightsGroup
from rollserve.client.weights.update_file import prepare_update
from rollserve.server.config import ServerConfig
from rollserve.server.models import ModelSet, load_models
from rollserve.server.serving.app import RolloutServer
from rollserve.server.serving.exit_codes import STOP_BOUND_S, ExitCode
from rollserve.server.weights.arena import StagingArena
from rollserve.server.weights.distributed import MAX_ABANDONED, MAX_JOINING, WeightsGroups
from rollserve.server.weights.parallel import MAX_WAITING_PARTS
from rollserve.v1 import rollout_pb2 as pb
from rollserve.v1 import rollout_pb2_grpc

DATA_TOKEN = "data-r2-Secr3t"
ADMIN_TOKEN = "admin-r2-Secr3t"
ADMIN = (("authorization", f"Bearer {ADMIN_TOKEN}"),)
DATA = (("authorization", f"Bearer {DATA_TOKEN}"),)
CALL_S = 5.0  # bound on a call that must answer at once
HEALTH_S = 1.0  # a probe must answer within this while an attack runs
GROUP_CAP_S = 2.0  # the server's --max-group-timeout-s in these tests
PART_WAIT_S = 2.0  # the server's --parallel-part-wait-s in these tests
Q0 = "model.layers.0.self_attn.q_proj"
MIB = 1 << 20


@pytest.fixture(scope="module")
def models(tiny_actor_dir: Path) -> ModelSet:
    return load_models(ServerConfig(device="cpu", actor=str(tiny_actor_dir)))


@pytest.fixture(scope="module")
def server(models: ModelSet) -> Iterator[RolloutServer]:
    config = ServerConfig(
        host="127.0.0.1",
        port=0,
        device="cpu",
        metrics_port=0,
        data_token=DATA_TOKEN,
        admin_token=ADMIN_TOKEN,
        max_group_timeout_s=GROUP_CAP_S,
        parallel_part_wait_s=PART_WAIT_S,
    )
    with RolloutServer(config, models=models) as running:
        yield running


@pytest.fixture(scope="module")
def channel(server: RolloutServer) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as opened:
        yield opened


def _stub(channel: grpc.Channel) -> rollout_pb2_grpc.RolloutStub:
    return rollout_pb2_grpc.RolloutStub(channel)


def _version(channel: grpc.Channel) -> int:
    return _stub(channel).Health(pb.HealthRequest(), metadata=DATA, timeout=CALL_S).policy_version


def _assert_probes_answer(channel: grpc.Channel) -> None:
    """Health and grpc.health.v1 Check, each within HEALTH_S."""
    _stub(channel).Health(pb.HealthRequest(), metadata=DATA, timeout=HEALTH_S)
    check = health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=""), timeout=HEALTH_S
    )
    assert check.status == health_pb2.HealthCheckResponse.SERVING


def _version_of(client: RolloutClient) -> int:
    return client.health().policy_version


def _update_error(channel: grpc.Channel, requests: list[pb.UpdateWeightsRequest]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        _stub(channel).UpdateWeights(iter(requests), metadata=ADMIN, timeout=CALL_S)
    return info.value


def _lora_adapter(module: torch.nn.Module, rank: int, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    out_features, in_features = module.get_submodule(Q0).weight.shape
    return {
        f"base_model.model.{Q0}.lora_A.weight": torch.randn(rank, in_features, generator=generator),
        f"base_model.model.{Q0}.lora_B.weight": torch.randn(out_features, rank, generator=generator)
        * 0.01,
    }


def _claimed_lora_head(rank: int, features: int) -> tuple[bytes, int]:
    """The head (length prefix and JSON header) of a float32 adapter of `rank` on a
    features x features weight, and the total_bytes it claims; the data is never sent."""
    factor_bytes = rank * features * 4
    header = {
        f"{Q0}.lora_A.weight": {
            "dtype": "F32",
            "shape": [rank, features],
            "data_offsets": [0, factor_bytes],
        },
        f"{Q0}.lora_B.weight": {
            "dtype": "F32",
            "shape": [features, rank],
            "data_offsets": [factor_bytes, 2 * factor_bytes],
        },
    }
    raw = json.dumps(header).encode()
    head = len(raw).to_bytes(8, "little") + raw
    return head, len(head) + 2 * factor_bytes


def _lora_header(version: int, rank: int, total_bytes: int) -> pb.WeightsHeader:
    return pb.WeightsHeader(
        target=pb.MODEL_ROLE_ACTOR,
        version=version,
        mode=pb.UPDATE_MODE_LORA,
        total_bytes=total_bytes,
        lora=pb.LoraAdapter(rank=rank, alpha=8.0),
    )


# ---- item 8: LoRA rank ---------------------------------------------------------------------------


@pytest.mark.parametrize("rank", [1 << 28, 1 << 19])
def test_a_lora_rank_above_the_module_is_refused_before_allocating(
    models: ModelSet, channel: grpc.Channel, rank: int
) -> None:
    module = models.actor.module
    features = module.get_submodule(Q0).weight.shape[0]
    head, total_bytes = _claimed_lora_head(rank, features)
    version = _version(channel)
    before_hash, before_rss = state_hash(module), rss_bytes(os.getpid())
    header = _lora_header(version + 1, rank, total_bytes)
    # The head only: were it not refused there, the server would allocate an arena for
    # total_bytes (137 GB: INTERNAL before the fix; 268 MB: kept for good) and then wait.
    error = _update_error(
        channel,
        [
            pb.UpdateWeightsRequest(header=header),
            pb.UpdateWeightsRequest(chunk=pb.WeightsChunk(offset=0, data=head)),
        ],
    )
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert "header.lora.rank" in error.details() and f"= {features}" in error.details()
    assert rss_bytes(os.getpid()) - before_rss < 64 * MIB  # the claim is 268 MB or more
    assert state_hash(module) == before_hash and _version(channel) == version
    # A valid adapter still merges.
    adapter = _lora_adapter(module, rank=features // 8, seed=rank % 97)
    requests = update_weights_requests(
        adapter,
        target="actor",
        version=version + 1,
        mode="lora",
        lora=pb.LoraAdapter(rank=features // 8, alpha=8.0),
    )
    reply = _stub(channel).UpdateWeights(requests, metadata=ADMIN, timeout=30.0)
    assert reply.version == version + 1 and _version(channel) == version + 1
    assert state_hash(module) != before_hash


def test_a_staging_arena_that_cannot_be_allocated_is_resource_exhausted() -> None:
    # What the 137 GB claim met before the rank bound (INTERNAL then); any update too large for
    # the host's memory still can.
    with pytest.raises(ResourceExhausted, match="cannot be allocated"):
        StagingArena().take(1 << 50)


# ---- item 6: the shared-memory source ------------------------------------------------------------


def _fifo(directory: Path) -> tuple[int, list[int]]:
    path = directory / "fifo"
    os.mkfifo(path)
    # Non-blocking, so that the test itself does not wait for a writer; the server's blocking
    # open of /proc/<pid>/fd/<fd> did, holding the update lock.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    return fd, [fd]


def _socket(directory: Path) -> tuple[int, list[int]]:
    fds = [end.detach() for end in socket.socketpair()]
    return fds[0], fds


@pytest.mark.parametrize(("kind", "make"), [("FIFO", _fifo), ("socket", _socket)])
def test_a_shared_memory_source_that_is_not_a_file_is_refused_unopened(
    models: ModelSet, channel: grpc.Channel, tmp_path: Path, kind: str, make: object
) -> None:
    fd, to_close = make(tmp_path)  # type: ignore[operator]
    try:
        version = _version(channel)
        header = pb.WeightsHeader(
            target=pb.MODEL_ROLE_ACTOR,
            version=version + 1,
            total_bytes=1 * MIB,
            shared_memory=pb.SharedMemorySource(pid=os.getpid(), fd=fd),
        )
        error = _update_error(channel, [pb.UpdateWeightsRequest(header=header)])
        assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, error.details()
        assert f"is a {kind}, not a memfd" in error.details()
    finally:
        for each in to_close:
            os.close(each)
    _assert_probes_answer(channel)
    # The update lock was not kept: the next update goes through at once.
    module = models.actor.module
    tensors = {Q0 + ".weight": module.get_submodule(Q0).weight.detach().clone() * 1.001}
    requests = update_weights_requests(tensors, target="actor", version=version + 1, mode="partial")
    reply = _stub(channel).UpdateWeights(requests, metadata=ADMIN, timeout=CALL_S)
    assert reply.version == version + 1 == _version(channel)


# ---- items 4 and 5: InitWeightsGroup -------------------------------------------------------------


def _join_request(group: str, port: int) -> pb.InitWeightsGroupRequest:
    return pb.InitWeightsGroupRequest(
        group=group,
        master_address="127.0.0.1",
        master_port=port,
        world_size=2,
        rank=1,
        timeout_s=3600.0,  # accepted, and capped by the server's --max-group-timeout-s
    )


def _groups(server: RolloutServer) -> WeightsGroups:
    assert server.updates is not None
    return server.updates.planes.groups


def test_init_weights_group_waits_at_most_the_cap_and_few_at_once(
    server: RolloutServer, channel: grpc.Channel
) -> None:
    # The attack: 16 calls (--max-workers) toward a closed port with timeout_s=3600. At most
    # MAX_JOINING rendezvous run; the rest are refused at once, and the probes keep answering.
    port = free_port()  # closed: nothing listens there
    started = time.monotonic()
    calls = [
        _stub(channel).InitWeightsGroup.future(
            _join_request(f"closed-{i}", port), metadata=ADMIN, timeout=60.0
        )
        for i in range(16)
    ]
    assert became_true(lambda: _groups(server).joining == MAX_JOINING, GROUP_CAP_S)
    _assert_probes_answer(channel)
    codes = []
    for call in calls:
        with pytest.raises(grpc.RpcError) as info:
            call.result(timeout=GROUP_CAP_S + 5.0)
        codes.append(info.value.code())
    elapsed = time.monotonic() - started
    waited = [c for c in codes if c is not grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert len(waited) == MAX_JOINING, codes
    assert set(waited) <= {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
    assert GROUP_CAP_S * 0.9 <= elapsed < GROUP_CAP_S + 3.0
    assert became_true(lambda: _groups(server).joining == 0, 1.0)
    _assert_probes_answer(channel)


def test_a_caller_that_leaves_frees_its_join_at_once(
    server: RolloutServer, channel: grpc.Channel
) -> None:
    port = free_port()
    calls = [
        _stub(channel).InitWeightsGroup.future(
            _join_request(f"left-{i}", port), metadata=ADMIN, timeout=60.0
        )
        for i in range(MAX_JOINING)
    ]
    assert became_true(lambda: _groups(server).joining == MAX_JOINING, GROUP_CAP_S)
    left = time.monotonic()
    for call in calls:
        call.cancel()
    # Well before the cap: the handlers returned and the joins stopped trying.
    assert became_true(lambda: _groups(server).joining == 0, GROUP_CAP_S / 2)
    assert time.monotonic() - left < GROUP_CAP_S / 2
    _assert_probes_answer(channel)


class _SilentMaster:
    """A port that accepts connections and never answers: torch's store client, once
    connected, waits on it for ever (whatever its timeout), until the port closes."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._accepted: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @property
    def accepted(self) -> int:
        return len(self._accepted)

    def _accept(self) -> None:
        while True:
            try:
                self._accepted.append(self._listener.accept()[0])
            except OSError:
                return  # closed

    def close(self) -> None:
        self._listener.close()
        self._thread.join(CALL_S)
        for connection in self._accepted:
            connection.close()


def test_joins_stuck_in_torch_after_their_caller_left_free_their_slots_and_are_bounded(
    server: RolloutServer, channel: grpc.Channel
) -> None:
    groups = _groups(server)
    master = _SilentMaster()
    try:
        for i in range(MAX_ABANDONED):
            call = _stub(channel).InitWeightsGroup.future(
                _join_request(f"silent-{i}", master.port), metadata=ADMIN, timeout=60.0
            )
            # The master probe, then the store's client: stuck in torch's C++ from here on.
            reached = 2 * (i + 1)
            assert became_true(lambda n=reached: master.accepted >= n, CALL_S), master.accepted
            call.cancel()
            assert became_true(lambda: groups.joining == 0, CALL_S)  # its slot is free at once
            assert groups.abandoned == i + 1
        _assert_probes_answer(channel)
        with pytest.raises(grpc.RpcError) as info:
            _stub(channel).InitWeightsGroup(
                _join_request("one-more", master.port), metadata=ADMIN, timeout=CALL_S
            )
        assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, info.value
        assert "abandoned" in (info.value.details() or "")
    finally:
        master.close()  # the store clients fail, see their callers left, and end
    # c10d retries a failed connection once after a backoff of up to a few seconds.
    assert became_true(lambda: groups.abandoned == 0, 4 * CALL_S), groups.abandoned


# ---- item 3: parallel parts ----------------------------------------------------------------------


def test_parts_waiting_for_an_unknown_leader_are_bounded(
    models: ModelSet, server: RolloutServer, channel: grpc.Channel
) -> None:
    # The attack: 16 headers of part 1 of updates whose part 0 never comes, each stream held open.
    assert server.updates is not None
    parallel = server.updates.planes.parallel
    release = threading.Event()

    def part(update_id: str) -> Iterator[pb.UpdateWeightsRequest]:
        header = pb.WeightsHeader(target=pb.MODEL_ROLE_ACTOR, version=1, total_bytes=1000)
        header.parallel.update_id = update_id
        header.parallel.streams, header.parallel.index = 2, 1
        header.parallel.begin, header.parallel.end = 500, 1000
        yield pb.UpdateWeightsRequest(header=header)
        release.wait(PART_WAIT_S + 5.0)  # the stream stays open

    calls = [
        _stub(channel).UpdateWeights.future(part(f"ghost-{i}"), metadata=ADMIN, timeout=30.0)
        for i in range(16)
    ]
    try:
        assert became_true(lambda: parallel.waiting == MAX_WAITING_PARTS, CALL_S)
        refused = 16 - MAX_WAITING_PARTS
        assert became_true(lambda: sum(call.done() for call in calls) == refused, CALL_S)
        done = [call for call in calls if call.done()]
        assert {call.code() for call in done} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
        _assert_probes_answer(channel)
        # A normal update goes through while the parts wait.
        version = _version(channel)
        module = models.actor.module
        tensors = {Q0 + ".weight": module.get_submodule(Q0).weight.detach().clone() * 0.999}
        requests = update_weights_requests(
            tensors, target="actor", version=version + 1, mode="partial"
        )
        reply = _stub(channel).UpdateWeights(requests, metadata=ADMIN, timeout=CALL_S)
        assert reply.version == version + 1
        # The waiting parts end by --parallel-part-wait-s, their streams still open (a stream
        # that ends ends its wait at once: test_a_waiting_part_whose_stream_ends_...).
        waited = [call for call in calls if call not in done]
        for call in waited:
            with pytest.raises(grpc.RpcError) as info:
                call.result(timeout=PART_WAIT_S + 5.0)
            assert info.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED, info.value.details()
    finally:
        release.set()
    assert parallel.waiting == 0


def test_a_waiting_part_whose_caller_leaves_frees_its_place_at_once(models: ModelSet) -> None:
    # Its stream read ahead on a thread of its own fails when the caller cancels, which ends
    # the wait (it used to hold its handler and its place in the pool for the whole wait).
    long_wait_s = 60.0
    config = ServerConfig(
        host="127.0.0.1", port=0, device="cpu", metrics_port=0, log_level="WARNING",
        parallel_part_wait_s=long_wait_s,
    )  # fmt: skip
    release = threading.Event()

    def part() -> Iterator[pb.UpdateWeightsRequest]:
        header = pb.WeightsHeader(target=pb.MODEL_ROLE_ACTOR, version=1, total_bytes=1000)
        header.parallel.update_id = "leaves"
        header.parallel.streams, header.parallel.index = 2, 1
        header.parallel.begin, header.parallel.end = 500, 1000
        yield pb.UpdateWeightsRequest(header=header)
        release.wait(long_wait_s)

    with (
        RolloutServer(config, models=models) as server,
        grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel,
    ):
        assert server.updates is not None
        parallel = server.updates.planes.parallel
        call = _stub(channel).UpdateWeights.future(part(), timeout=long_wait_s)
        try:
            assert became_true(lambda: parallel.waiting == 1, CALL_S)
            call.cancel()
            assert became_true(lambda: parallel.waiting == 0, long_wait_s / 6)  # not the whole wait
        finally:
            release.set()
        _assert_probes_answer(channel)


def test_a_waiting_part_whose_stream_ends_after_its_header_answers_at_once(
    models: ModelSet,
) -> None:
    # grpc reports a cancel as a plain end of the request stream now and then (the receive
    # completes empty before the call is marked cancelled): an end must end the wait as a failed
    # read does, or that cancelled part holds its place for the whole wait.
    long_wait_s = 60.0
    config = ServerConfig(
        host="127.0.0.1", port=0, device="cpu", metrics_port=0, log_level="WARNING",
        parallel_part_wait_s=long_wait_s,
    )  # fmt: skip
    header = pb.WeightsHeader(target=pb.MODEL_ROLE_ACTOR, version=1, total_bytes=1000)
    header.parallel.update_id = "ends"
    header.parallel.streams, header.parallel.index = 2, 1
    header.parallel.begin, header.parallel.end = 500, 1000
    with (
        RolloutServer(config, models=models) as server,
        grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel,
    ):
        assert server.updates is not None
        with pytest.raises(grpc.RpcError) as raised:
            _stub(channel).UpdateWeights(
                iter([pb.UpdateWeightsRequest(header=header)]), timeout=long_wait_s / 6
            )
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raised.value.details()
        assert "ended after its header" in (raised.value.details() or "")
        assert server.updates.planes.parallel.waiting == 0


def test_a_part_that_waited_for_its_part_0_stages_the_message_it_read_ahead(
    models: ModelSet, server: RolloutServer, channel: grpc.Channel
) -> None:
    # Part 1 (header and chunks) first; it waits, having read its first chunk ahead; then
    # part 0: the update applies whole.
    assert server.updates is not None
    parallel = server.updates.planes.parallel
    module = models.actor.module
    version = _version(channel)
    weights = {Q0 + ".weight": module.get_submodule(Q0).weight.detach().clone() * 1.01}
    update = prepare_update(weights, target="actor", version=version + 1, mode="partial",
                            chunk_bytes=256 * 1024)  # fmt: skip
    middle = update.total_bytes // 2 // 8 * 8
    encoded = []
    for index, (begin, end) in enumerate([(0, middle), (middle, update.total_bytes)]):
        header = pb.WeightsHeader()
        header.CopyFrom(update.header)
        header.parallel.update_id = f"ahead-{version}"
        header.parallel.streams, header.parallel.index = 2, index
        header.parallel.begin, header.parallel.end = begin, end
        encoded.append(list(update.messages(header, begin, end)))
    call = update_weights_callable(channel)
    second = call.future(iter(encoded[1]), metadata=ADMIN, timeout=30.0)
    assert became_true(lambda: parallel.waiting == 1, CALL_S)
    first = call.future(iter(encoded[0]), metadata=ADMIN, timeout=30.0)
    assert first.result().version == second.result().version == version + 1
    assert torch.equal(module.get_submodule(Q0).weight, weights[Q0 + ".weight"])


def test_sigterm_ends_the_process_while_a_rendezvous_is_stuck() -> None:
    # Issue 22, item 5 for InitWeightsGroup: the trainer's port accepts and never answers, so
    # the rendezvous is stuck inside c10d; SIGTERM must still end the process within the grace.
    grace_s = 1.0
    with socket.create_server(("127.0.0.1", 0)) as mute:
        proc, port = start_server_process(
            "--device", "cpu", "--metrics-port", "0", "--admin-token", ADMIN_TOKEN,
            "--data-token", DATA_TOKEN, "--shutdown-grace-s", str(grace_s),
        )  # fmt: skip
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as to_server:
                call = _stub(to_server).InitWeightsGroup.future(
                    _join_request("mute", mute.getsockname()[1]), metadata=ADMIN, timeout=60.0
                )
                mute.settimeout(CALL_S)
                accepted, _ = mute.accept()  # the rendezvous reached the trainer's port
                with accepted:
                    stopped = time.monotonic()
                    # In flight when the grace ended: cancelled, its handler freed; the
                    # rendezvous thread, stuck in c10d, is work left behind (exit 4, os._exit:
                    # a thread that leaves torch while the interpreter finalizes aborts it).
                    code = proc.terminate_and_wait(timeout_s=grace_s + 10.0)
                    took_s = time.monotonic() - stopped
                    assert code == ExitCode.ABANDONED, (code, took_s, proc.log_text()[-3000:])
                    assert "weights-group rendezvous in torch" in proc.log_text()
                    # The promise (grace + STOP_BOUND_S), and 2 s for the interpreter's exit on
                    # a loaded machine.
                    assert took_s < grace_s + STOP_BOUND_S + 2.0, (took_s, proc.log_text()[-3000:])
                with pytest.raises(grpc.RpcError):
                    call.result(timeout=CALL_S)
        finally:
            proc.terminate_and_wait()


# ---- the example trainer's race: a WeightsGroup and a server still loading -----------------------


def _spawn_unready(*args: str) -> tuple[ServerProcess, int]:
    """A server process on a chosen port, returned at once: not listening yet, then loading."""
    port = free_port()
    workdir = Path(tempfile.mkdtemp(prefix="rollserve-unready-"))
    command = [sys.executable, "-m", "rollserve.server", "serve", "--host", "127.0.0.1"]
    command += ["--port", str(port), *args]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLSERVE_")}
    with open(workdir / "server.log", "wb") as log:
        proc = ServerProcess(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    proc.log_path = workdir / "server.log"
    return proc, port


def _q0_update(models: ModelSet, scale: float) -> dict[str, torch.Tensor]:
    return {Q0 + ".weight": models.actor.module.get_submodule(Q0).weight.detach() * scale}


def test_a_weights_group_waits_for_a_server_that_is_still_loading(
    models: ModelSet, tiny_actor_dir: Path
) -> None:
    proc, port = _spawn_unready("--device", "cpu", "--metrics-port", "0",
                                "--actor", str(tiny_actor_dir))  # fmt: skip
    try:
        with RolloutClient(f"127.0.0.1:{port}", timeout_s=60.0) as client:
            # Not SERVING yet (the interpreter has not even imported torch): InitWeightsGroup
            # would be refused, or answered UNAVAILABLE "the server is loading".
            try:
                assert not client.health(timeout_s=0.5).serving
            except RolloutError:
                pass  # not listening yet
            with WeightsGroup([client], timeout_s=60.0) as group:
                (result,) = group.update_weights(
                    _q0_update(models, 1.001), version=1, mode="partial"
                )
            assert result.version == 1 == client.health().policy_version
    finally:
        assert proc.terminate_and_wait() == 0, proc.log_text()


def _join_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "weights-group-join"]


def test_a_weights_group_that_cannot_be_formed_fails_at_once_and_frees_its_store(
    models: ModelSet, server: RolloutServer
) -> None:
    target = f"127.0.0.1:{server.port}"
    with (
        RolloutClient(target, timeout_s=CALL_S, token=ADMIN_TOKEN) as admin,
        RolloutClient(target, timeout_s=CALL_S, token=DATA_TOKEN) as stranger,
    ):
        master_port = free_port()
        started = time.monotonic()
        # The admin member's join waits in the rendezvous for the data-token member's, which
        # InitWeightsGroup refuses (Health, which the group asks first, answers it).
        with pytest.raises(RolloutError) as info:
            WeightsGroup([admin, stranger], master_port=master_port, timeout_s=60.0)
        assert info.value.code in {
            grpc.StatusCode.UNAUTHENTICATED,
            grpc.StatusCode.PERMISSION_DENIED,
        }, info.value
        assert time.monotonic() - started < 10.0  # not the store's 60 s
        # The group's own join thread ends once the store is gone (the client waits for it up
        # to 5 s; on a loaded host it ended just after: a clean CI run, 2026-11-28).
        assert became_true(lambda: not _join_threads(), CALL_S)
        with pytest.raises(ConnectionRefusedError):  # the store's port is closed
            socket.create_connection(("127.0.0.1", master_port), timeout=CALL_S).close()
        assert became_true(lambda: _groups(server).joining == 0, CALL_S)
        # The next attempt works.
        version = _version_of(admin)
        with WeightsGroup([admin], timeout_s=60.0) as group:
            weights = _q0_update(models, 0.999)
            (result,) = group.update_weights(weights, version=version + 1, mode="partial")
        assert result.version == version + 1
        # The first group's join on the server (its caller cancelled) leaves torch soon after.
        assert became_true(lambda: _groups(server).abandoned == 0, 4 * CALL_S)


# ---- issue item 1: readers that never read -------------------------------------------------------

SEND_S = 4.0  # the server's --stream-send-timeout-s in this test
# A channel that takes little before its reader reads: no BDP probing (the window stays at its
# start) and a small lookahead.
_SMALL_WINDOWS = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 16384)]


def _bulky_request(rows: int, micro_batch: int) -> pb.MakeExperienceRequest:
    """Micro-batches of `micro_batch` rows x 32 new tokens: over 100 KB each, more than a
    small window holds, so a reader that never reads blocks the server's first send."""
    return pb.MakeExperienceRequest(
        token_ids=pb.RaggedTokenIds(values=[5, 6, 7] * rows, lengths=[3] * rows),
        sampling=pb.SamplingOptions(max_new_tokens=32, seed=5, ignore_eos=True),
        rewards=[pb.RewardTerm(source="exact_match")],
        gt_answers=["x"] * rows,
        batching=pb.BatchingOptions(micro_batch_size=micro_batch, generate_batch_size=micro_batch),
        algorithm=pb.AlgorithmOptions(whitening="none"),  # rows stream as they are made
    )


def test_readers_that_never_read_neither_starve_probes_nor_hold_threads(
    models: ModelSet,
) -> None:
    workers = 4
    config = ServerConfig(
        host="127.0.0.1", port=0, device="cpu", metrics_port=0, data_token=DATA_TOKEN,
        admin_token=ADMIN_TOKEN, max_workers=workers, stream_send_timeout_s=SEND_S,
    )  # fmt: skip
    with RolloutServer(config, models=models) as server:
        assert server.send_deadlines is not None and server.call_limit is not None
        deadlines, slots = server.send_deadlines, server.call_limit.slots
        target = f"127.0.0.1:{server.port}"
        stuck = [grpc.insecure_channel(target, options=_SMALL_WINDOWS) for _ in range(workers)]
        try:
            calls = [
                _stub(channel).MakeExperience(_bulky_request(128, 64), metadata=DATA, timeout=60.0)
                for channel in stuck
            ]
            # Every slot is held by a handler waiting for its reader to take a message.
            assert became_true(lambda: deadlines.armed == workers, 30.0), deadlines.armed
            assert slots.held == workers
            with grpc.insecure_channel(target) as channel:
                _assert_probes_answer(channel)
                extra = _stub(channel).MakeExperience(
                    _bulky_request(1, 1), metadata=DATA, timeout=CALL_S
                )
                with pytest.raises(grpc.RpcError) as info:
                    next(extra)
                assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "--max-workers" in info.value.details()
                # After the send timeout the streams end and their threads are free.
                assert became_true(lambda: slots.held == 0, SEND_S + 5.0), slots.held
                for call in calls:
                    with pytest.raises(grpc.RpcError) as info:
                        list(call)
                    assert info.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
                    assert "--stream-send-timeout-s" in info.value.details()
                assert deadlines.expired == workers
                # A reader that reads is served in full.
                replies = list(
                    _stub(channel).MakeExperience(_bulky_request(4, 2), metadata=DATA, timeout=30.0)
                )
                assert len(replies) == replies[0].num_micro_batches == 2
        finally:
            for channel in stuck:
                channel.close()


# ---- issue item 2: a subscriber that never reads -------------------------------------------------

SUBSCRIBE_SEND_S = 8.0  # the server's --stream-send-timeout-s in this test


def _rollout_files(directory: Path) -> tuple[Path, Path]:
    """32 prompts and a template whose batches (64 rows x 32 new tokens) are over 100 KB each,
    more than a small window holds."""
    prompts = directory / "prompts.jsonl"
    lines = [json.dumps({"prompt": f"q{i}=", "gt_answer": str(i)}) for i in range(32)]
    prompts.write_text("\n".join(lines) + "\n")
    template = directory / "request.json"
    template.write_text(
        json.dumps(
            {
                "samplesPerPrompt": 2,
                "sampling": {"maxNewTokens": 32, "ignoreEos": True},
                "algorithm": {"advantageEstimator": "group_norm"},
                "rewards": [{"source": "exact_match"}],
            }
        )
    )
    return prompts, template


def test_a_subscriber_that_never_reads_does_not_stop_the_rollout(
    models: ModelSet, tmp_path: Path
) -> None:
    prompts, template = _rollout_files(tmp_path)
    config = ServerConfig(
        host="127.0.0.1", port=0, device="cpu", metrics_port=0,
        stream_send_timeout_s=SUBSCRIBE_SEND_S, rollout_prompts=str(prompts),
        rollout_request=str(template), rollout_prompts_per_batch=32, rollout_epochs=0,
    )  # fmt: skip
    with RolloutServer(config, models=models) as server:
        assert server.rollout is not None and server.send_deadlines is not None
        rollout, deadlines = server.rollout, server.send_deadlines
        target = f"127.0.0.1:{server.port}"
        with grpc.insecure_channel(target, options=_SMALL_WINDOWS) as stuck_channel:
            # Window 0 (a client from before windows): every batch counts as taken once gRPC
            # accepts it, so the handler blocks sending to a reader that never reads.
            stuck = _stub(stuck_channel).Subscribe(
                iter([pb.SubscribeRequest(subscriber_id="stuck")]), timeout=60.0
            )
            # First in the ring, dealt a batch, and its handler blocked sending it.
            assert became_true(lambda: deadlines.armed == 1, 30.0)
            started = time.monotonic()
            with RolloutClient(target, timeout_s=30.0) as client:
                batches = list(client.subscribe("reader", max_batches=3))
            took_s = time.monotonic() - started
            assert len(batches) == 3
            # Dealt around the stuck subscriber, not after its send deadline ended it.
            assert took_s < SUBSCRIBE_SEND_S, took_s
            assert deadlines.expired == 0 and rollout.stats().subscribers == 1
            # Then it loses its subscription.
            assert became_true(lambda: rollout.stats().subscribers == 0, SUBSCRIBE_SEND_S + 5.0)
            with pytest.raises(grpc.RpcError) as info:
                list(stuck)
            assert info.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED


# ---- issue item 7: back-pressure, and staleness checked at hand-over ----------------------------

TRAINER_STEPS = 8
QUEUE = 4  # the server's --rollout-queue-batches in these tests


def _small_rollout_files(directory: Path) -> tuple[Path, Path]:
    """16 prompts, 2 per batch, 2 samples each, 4 new tokens: batches made in a few ms."""
    prompts = directory / "prompts.jsonl"
    lines = [json.dumps({"prompt": f"q{i}=", "gt_answer": str(i)}) for i in range(16)]
    prompts.write_text("\n".join(lines) + "\n")
    template = directory / "request.json"
    template.write_text(
        json.dumps(
            {
                "samplesPerPrompt": 2,
                "sampling": {"maxNewTokens": 4},
                "algorithm": {"advantageEstimator": "group_norm"},
                "rewards": [{"source": "exact_match"}],
            }
        )
    )
    return prompts, template


def _rollout_server(models: ModelSet, tmp_path: Path, **config: object) -> RolloutServer:
    prompts, template = _small_rollout_files(tmp_path)
    settings = dict(
        host="127.0.0.1", port=0, device="cpu", metrics_port=0, log_level="WARNING",
        rollout_prompts=str(prompts), rollout_request=str(template),
        rollout_prompts_per_batch=2, rollout_epochs=0, rollout_queue_batches=QUEUE,
    )  # fmt: skip
    return RolloutServer(ServerConfig(**{**settings, **config}), models=models)


@pytest.mark.parametrize("window", [1, 2])
def test_a_trainer_that_pushes_after_each_batch_reads_fresh_batches_and_nothing_runs_ahead(
    models: ModelSet, tmp_path: Path, window: int
) -> None:
    # The trainer: read a batch, train a while, push version + 1. It used to read
    # batches 0 to 14 versions old while the server made 1,305 batches for the 15 it read.
    # Here "a while" is until the server made every batch it may (it then waits): the most
    # a trainer of any speed can let it make.
    weights = {k: t.detach().clone() for k, t in models.actor.module.state_dict().items()}
    with _rollout_server(models, tmp_path) as server:  # --max-staleness 1 (the default)
        assert server.rollout is not None
        rollout, target = server.rollout, f"127.0.0.1:{server.port}"
        lags: list[int] = []
        with RolloutClient(target, timeout_s=60.0) as client:
            stream = client.subscribe("trainer", window=window, timeout_s=60.0)
            for version in range(TRAINER_STEPS):
                batch = next(stream)  # acknowledges the one before
                lags.append(version - int(batch.experience.policy_version.min()))
                taken = version + 1
                # One batch made ahead (the one taken next), the window handed over: then the
                # loop waits.
                assert became_true(lambda: rollout.stats().queued == 1, CALL_S)
                stats = rollout.stats()
                assert stats.made <= taken + window + QUEUE, stats
                assert stats.delivered <= taken + window - 1, stats
                client.update_weights(weights, version=version + 1)
            stream.close()
        # Handed over within --max-staleness; read at most window - 1 pushes later.
        assert max(lags) <= 1 + (window - 1), lags
        stats = rollout.stats()
        assert stats.dropped_stale == 0 and stats.made <= TRAINER_STEPS + window + QUEUE, stats


def test_a_batch_that_went_stale_in_the_queue_is_dropped_at_hand_over(
    models: ModelSet, tmp_path: Path
) -> None:
    weights = {k: t.detach().clone() for k, t in models.actor.module.state_dict().items()}
    with _rollout_server(models, tmp_path) as server:
        assert server.rollout is not None
        rollout, target = server.rollout, f"127.0.0.1:{server.port}"
        with RolloutClient(target, timeout_s=60.0) as client:
            stream = client.subscribe("slow", timeout_s=60.0)
            assert int(next(stream).experience.policy_version.max()) == 0
            assert became_true(lambda: rollout.stats().queued == 1, CALL_S)  # made by version 0
            client.update_weights(weights, version=1)
            client.update_weights(weights, version=2)  # the queued batch is 2 versions behind
            batch = next(stream)
            assert batch.experience.policy_version.tolist() == [2] * 4
            stream.close()
        stats = rollout.stats()
        assert (stats.dropped_stale, stats.delivered) == (1, 2)


def _subscribe_calls(
    channel: grpc.Channel, requests: list[pb.SubscribeRequest], release: threading.Event
) -> Iterator[pb.SubscribeResponse]:
    def stream() -> Iterator[pb.SubscribeRequest]:
        yield from requests
        release.wait(CALL_S)  # the request side stays open until the test is done

    return _stub(channel).Subscribe(stream(), timeout=30.0)


@pytest.mark.parametrize(
    ("requests", "message"),
    [
        ([pb.SubscribeRequest(window=17)], "window: must be 0 (no acknowledgements) to 16"),
        ([pb.SubscribeRequest(window=1, taken=1)], "taken: the first request opens"),
        ([pb.SubscribeRequest(window=1), pb.SubscribeRequest(taken=2)], "taken: must be 1 to"),
        ([pb.SubscribeRequest(window=1), pb.SubscribeRequest(window=1)], "only acknowledges"),
    ],
)
def test_bad_subscribe_requests_are_invalid_argument(
    models: ModelSet, tmp_path: Path, requests: list[pb.SubscribeRequest], message: str
) -> None:
    release = threading.Event()
    with (
        _rollout_server(models, tmp_path) as server,
        grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel,
    ):
        try:
            with pytest.raises(grpc.RpcError) as info:
                list(_subscribe_calls(channel, requests, release))
        finally:
            release.set()
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        assert message in info.value.details()
        assert server.rollout is not None
        assert became_true(lambda: server.rollout.stats().subscribers == 0, CALL_S)


def test_a_client_from_before_windows_still_subscribes(models: ModelSet, tmp_path: Path) -> None:
    # The method's old shape: one request on a server-streaming call (window unset). The wire
    # is the same as a bidirectional call whose client sends one message and closes its side.
    with (
        _rollout_server(models, tmp_path) as server,
        grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel,
    ):
        old_subscribe = channel.unary_stream(
            "/rollserve.v1.Rollout/Subscribe",
            request_serializer=pb.SubscribeRequest.SerializeToString,
            response_deserializer=pb.SubscribeResponse.FromString,
        )
        replies = list(old_subscribe(pb.SubscribeRequest(max_batches=3), timeout=30.0))
        assert [reply.batch_index for reply in replies] == [0, 1, 2]


def test_closing_the_request_side_ends_the_stream_once_the_window_is_used(
    models: ModelSet, tmp_path: Path
) -> None:
    with (
        _rollout_server(models, tmp_path) as server,
        grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel,
    ):
        requests = [pb.SubscribeRequest(subscriber_id="two", window=2)]
        replies = list(_stub(channel).Subscribe(iter(requests), timeout=30.0))
        assert [reply.batch_index for reply in replies] == [0, 1]  # its window, then OK
