"""Faults of the parallel-stream and torch.distributed data planes, and both against real
server processes: a part cut, doubled, disagreeing, overlapping or missing; an unknown group,
bad group settings, a refusal before the broadcast, and a trainer killed mid-broadcast. After
each: a clear status, the old weights serving bit for bit, and the next update lands.
"""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from helpers_server import start_server_process
from helpers_weights import perturbed, state_hash
from rollserve.client import RolloutClient
from rollserve.client.protocol.errors import FailedPrecondition, Unavailable
from rollserve.client.protocol.wire import update_weights_callable
from rollserve.client.weights.distributed import WeightsGroup
from rollserve.client.weights.update_file import prepare_update
from rollserve.server.config import ServerConfig
from rollserve.server.models import ModelSet, load_models
from rollserve.server.models.default_model import TinyModelSpec, save_tiny_causal_lm
from rollserve.server.serving.app import RolloutServer
from rollserve.v1 import rollout_pb2 as pb
from rollserve.v1 import rollout_pb2_grpc

KIB = 1024
SPEC = TinyModelSpec(hidden_size=128, intermediate_size=1024)
WAIT_S = 30.0
PROMPTS = [[1, 72, 101, 108, 108], [1, 50, 51]]
GREEDY = dict(max_new_tokens=6, temperature=0.0, seed=3, rewards=["exact_match"],
              gt_answers=["a", "b"], algorithm={"whitening": "none"})  # fmt: skip


@pytest.fixture(scope="module")
def actor_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_causal_lm(tmp_path_factory.mktemp("faults-actor"), SPEC)


@pytest.fixture(scope="module")
def models(actor_dir: Path) -> ModelSet:
    return load_models(ServerConfig(device="cpu", actor=str(actor_dir)))


@pytest.fixture
def server(models: ModelSet) -> Iterator[RolloutServer]:
    config = ServerConfig(
        host="127.0.0.1",
        port=0,
        device="cpu",
        metrics_port=0,
        parallel_part_wait_s=2.0,  # a missing part fails fast here
    )
    with RolloutServer(config, models=models) as running:
        yield running


# ---- parallel streams ---------------------------------------------------------------------------


def _parts(weights, version: int, ranges: list[tuple[int, int]], update_id: str = "u1",
           streams: int | None = None, **header_changes: object) -> list[list[bytes]]:  # fmt: skip
    """Each part's encoded messages: its header (ParallelPart set), then its chunks."""
    update = prepare_update(weights, target="actor", version=version, mode="full",
                            chunk_bytes=256 * KIB)  # fmt: skip
    parts = []
    for index, (begin, end) in enumerate(ranges):
        header = copy.deepcopy(update.header)
        header.parallel.update_id = update_id
        header.parallel.streams = streams or len(ranges)
        header.parallel.index = index
        header.parallel.begin, header.parallel.end = begin, end
        for field, value in header_changes.get(f"part{index}", {}).items():  # type: ignore[union-attr]
            setattr(header, field, value)
        parts.append(list(update.messages(header, begin, end)))
    return parts


def _ranges(weights, count: int) -> list[tuple[int, int]]:
    total = prepare_update(weights, target="actor", version=1, mode="full").total_bytes
    cuts = [0, *(total * i // count // 8 * 8 for i in range(1, count)), total]
    return list(zip(cuts, cuts[1:], strict=False))


def _send_parts(address: str, parts: list[list[bytes]], cut_part: int | None = None) -> list:
    """Send every part on its own connection at once; each call's reply or grpc.RpcError."""
    channels = [grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in parts]  # fmt: skip
    try:
        futures = []
        for index, (channel, messages) in enumerate(zip(channels, parts, strict=True)):

            def stream(messages=messages, cut=index == cut_part) -> Iterator[bytes]:
                for position, message in enumerate(messages):
                    if cut and position == len(messages) // 2:
                        raise RuntimeError("the trainer's reader broke")  # gRPC cancels the call
                    yield message

            call = update_weights_callable(channel)
            futures.append(call.future(stream(), timeout=WAIT_S))
        outcomes = []
        for future in futures:
            try:
                outcomes.append(future.result())
            except grpc.RpcError as error:
                outcomes.append(error)
        return outcomes
    finally:
        for channel in channels:
            channel.close()


def _codes(outcomes: list) -> set:
    return {o.code() if isinstance(o, grpc.RpcError) else grpc.StatusCode.OK for o in outcomes}


def test_parallel_parts_that_go_wrong_fail_every_part_and_change_nothing(
    models: ModelSet, server: RolloutServer
) -> None:
    actor = models.actor.module
    before = state_hash(actor)
    weights = perturbed(actor, seed=3)
    ranges = _ranges(weights, 3)
    cut = _send_parts(server.address, _parts(weights, 1, ranges, "cut"), cut_part=2)
    assert grpc.StatusCode.OK not in _codes(cut), cut
    disagree = _send_parts(
        server.address, _parts(weights, 1, ranges, "disagree", part1={"version": 7})
    )
    assert any(
        "differs from part 0" in o.details() for o in disagree if isinstance(o, grpc.RpcError)
    )
    overlap = [(0, ranges[1][0] + 64), (ranges[1][0], ranges[1][1]), ranges[2]]
    overlapping = _send_parts(server.address, _parts(weights, 1, overlap, "overlap"))
    assert _codes(overlapping) == {grpc.StatusCode.INVALID_ARGUMENT}, overlapping
    missing = _send_parts(server.address, _parts(weights, 1, ranges[:2], "missing", streams=3))
    assert grpc.StatusCode.DEADLINE_EXCEEDED in _codes(missing), missing
    doubled = _parts(weights, 1, ranges, "doubled")
    doubled[2] = doubled[1]
    assert grpc.StatusCode.OK not in _codes(_send_parts(server.address, doubled))
    assert state_hash(actor) == before
    with RolloutClient(server.address, timeout_s=WAIT_S) as client:
        assert client.health().policy_version == 0
    head_bytes = len(prepare_update(weights, target="actor", version=1, mode="full").layout()[0])
    inside_head = [(0, head_bytes - 8), (head_bytes - 8, ranges[1][1]), ranges[2]]
    cut_head = _send_parts(server.address, _parts(weights, 1, inside_head, "inside-head"))
    assert _codes(cut_head) == {grpc.StatusCode.INVALID_ARGUMENT}, cut_head
    # Part 0 must hold at least the head: exactly the head is enough.
    just_head = [(0, head_bytes), (head_bytes, ranges[1][1]), ranges[2]]
    good = _send_parts(server.address, _parts(weights, 1, just_head, "good"))
    assert _codes(good) == {grpc.StatusCode.OK} and {r.version for r in good} == {1}
    assert {r.transport for r in good} == {"grpc-parallel"}
    expected = copy.deepcopy(actor)
    expected.load_state_dict(weights)
    assert state_hash(actor) == state_hash(expected)


# ---- torch.distributed: settings, unknown groups, refusals ---------------------------------------


def test_weights_group_settings_are_checked(server: RolloutServer) -> None:
    with grpc.insecure_channel(server.address) as channel:
        stub = rollout_pb2_grpc.RolloutStub(channel)
        good = dict(group="g1", master_address="127.0.0.1", master_port=29999, world_size=2,
                    rank=1, timeout_s=2.0)  # fmt: skip
        cases = [
            ({"group": "bad/name"}, grpc.StatusCode.INVALID_ARGUMENT, "group"),
            ({"rank": 0}, grpc.StatusCode.INVALID_ARGUMENT, "rank"),
            ({"world_size": 1}, grpc.StatusCode.INVALID_ARGUMENT, "world_size"),
            ({"world_size": 2**31 - 1}, grpc.StatusCode.INVALID_ARGUMENT, "world_size"),
            ({"master_address": "host\x00x"}, grpc.StatusCode.INVALID_ARGUMENT, "master_address"),
            ({"master_port": 0}, grpc.StatusCode.INVALID_ARGUMENT, "master_port"),
            ({"backend": "mpi"}, grpc.StatusCode.INVALID_ARGUMENT, "backend"),
            ({"backend": "nccl"}, grpc.StatusCode.FAILED_PRECONDITION, "nccl"),
            ({"timeout_s": -1.0}, grpc.StatusCode.INVALID_ARGUMENT, "timeout_s"),
            ({"lanes": 9}, grpc.StatusCode.INVALID_ARGUMENT, "lanes"),
            ({"lanes": -1}, grpc.StatusCode.INVALID_ARGUMENT, "lanes"),
            ({}, grpc.StatusCode.UNAVAILABLE, "rendezvous"),  # nobody listens at the master
        ]
        for change, code, word in cases:
            with pytest.raises(grpc.RpcError) as raised:
                stub.InitWeightsGroup(
                    pb.InitWeightsGroupRequest(**{**good, **change}), timeout=WAIT_S
                )
            assert raised.value.code() == code, (change, raised.value.details())
            assert word in raised.value.details(), (change, raised.value.details())
        with pytest.raises(grpc.RpcError) as raised:
            stub.DestroyWeightsGroup(pb.DestroyWeightsGroupRequest(group="g1"), timeout=WAIT_S)
        assert raised.value.code() == grpc.StatusCode.NOT_FOUND


def test_an_unknown_group_and_a_refused_vote_leave_the_group_usable(
    models: ModelSet, server: RolloutServer
) -> None:
    actor = models.actor.module
    update = prepare_update(perturbed(actor, seed=1), target="actor", version=1, mode="full")
    header = copy.deepcopy(update.header)
    header.distributed.group = "nobody"
    head_bytes = len(update.layout()[0])
    with grpc.insecure_channel(server.address) as channel, pytest.raises(grpc.RpcError) as raised:
        update_weights_callable(channel)(update.messages(header, 0, head_bytes), timeout=WAIT_S)
    assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "no weights group 'nobody'" in raised.value.details()
    with RolloutClient(server.address, timeout_s=WAIT_S) as client:
        with WeightsGroup([client], timeout_s=WAIT_S) as group:
            client.update_weights(perturbed(actor, seed=1), version=1, group=group)
            before = state_hash(actor)
            started = time.monotonic()
            with pytest.raises(FailedPrecondition, match="not above"):
                client.update_weights(perturbed(actor, seed=2), version=1, group=group)
            assert time.monotonic() - started < 10.0  # refused by the vote, not by a timeout
            assert state_hash(actor) == before
            result = client.update_weights(perturbed(actor, seed=2), version=2, group=group)
            assert (result.version, result.transport) == (2, "dist")


# ---- against real server processes -------------------------------------------------------------

_TRAINER = textwrap.dedent(
    """
    import sys, time
    from safetensors.torch import load_file
    from rollserve.client import RolloutClient
    from rollserve.client.weights.distributed import WeightsGroup

    target, weights_file = sys.argv[1], sys.argv[2]
    weights = {name: tensor + 0.5 for name, tensor in load_file(weights_file).items()}
    client = RolloutClient(target, timeout_s=60)
    group = WeightsGroup([client], timeout_s=20, bucket_bytes=64 * 1024)

    def progress(sent, total):
        if sent > total // 3:
            print("midway", flush=True)
            time.sleep(60)  # the test kills this process here, mid-broadcast

    group.update_weights(weights, version=1, progress=progress)
    """
)


def _greedy_log_probs(client: RolloutClient) -> torch.Tensor:
    experience = client.make_experience(PROMPTS, **GREEDY)
    return experience.action_log_probs[experience.action_mask]


def test_processes_shared_memory_and_a_trainer_killed_mid_broadcast(actor_dir: Path) -> None:
    from safetensors.torch import load_file

    weights_file = actor_dir / "model.safetensors"
    proc, port = start_server_process("--device", "cpu", "--actor", str(actor_dir))
    target = f"127.0.0.1:{port}"
    try:
        with RolloutClient(target, timeout_s=WAIT_S) as client:
            before = _greedy_log_probs(client)
            trainer = subprocess.Popen(
                [sys.executable, "-c", _TRAINER, target, str(weights_file)],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            try:
                assert trainer.stdout is not None
                line = trainer.stdout.readline()
                assert line.strip() == "midway", line + trainer.stdout.read()
            finally:
                trainer.send_signal(signal.SIGKILL)
                trainer.wait(timeout=WAIT_S)
            # The server's broadcast fails at once (the peer is gone); the old weights serve.
            deadline = time.monotonic() + WAIT_S
            while "weights group" not in proc.log_text() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert client.health().policy_version == 0
            assert torch.equal(_greedy_log_probs(client), before)
            # Shared memory across processes, chosen by "auto"; then a new group works.
            new = {name: tensor * 0.5 for name, tensor in load_file(weights_file).items()}
            result = client.update_weights(new, version=1)
            assert (result.version, result.transport) == (1, "shm")
            after_shm = _greedy_log_probs(client)
            assert not torch.equal(after_shm, before)
            with WeightsGroup([client], timeout_s=WAIT_S) as group:
                result = client.update_weights(load_file(weights_file), version=2, group=group)
            assert (result.version, result.transport) == (2, "dist")
            assert torch.equal(_greedy_log_probs(client), before)  # the original weights again
    finally:
        assert proc.terminate_and_wait() == 0, proc.log_text()


def test_a_server_killed_mid_broadcast_frees_the_other_servers_at_once(actor_dir: Path) -> None:
    """One broadcast to two server processes; one is killed midway. The trainer's update fails
    (UNAVAILABLE) and it closes its lanes, so the other server's receives fail at once instead
    of after the group's 60 s timeout: it keeps its old weights and takes the next update."""
    from safetensors.torch import load_file

    weights_file = actor_dir / "model.safetensors"
    survivor, survivor_port = start_server_process("--device", "cpu", "--actor", str(actor_dir))
    victim, victim_port = start_server_process("--device", "cpu", "--actor", str(actor_dir))
    try:
        with (
            RolloutClient(f"127.0.0.1:{survivor_port}", timeout_s=WAIT_S) as kept,
            RolloutClient(f"127.0.0.1:{victim_port}", timeout_s=WAIT_S) as lost,
        ):
            before = _greedy_log_probs(kept)
            weights = {name: tensor + 0.5 for name, tensor in load_file(weights_file).items()}
            group = WeightsGroup([kept, lost], timeout_s=60, bucket_bytes=64 * 1024)

            def progress(sent: int, total: int) -> None:
                if sent > total // 3 and victim.poll() is None:
                    victim.send_signal(signal.SIGKILL)
                    victim.wait(timeout=WAIT_S)

            started = time.monotonic()
            with pytest.raises(Unavailable, match="broken|failed|closed|reset|Connection"):
                group.update_weights(weights, version=1, progress=progress)
            assert kept.health().policy_version == 0
            assert torch.equal(_greedy_log_probs(kept), before)
            result = kept.update_weights(weights, version=1, transport="grpc")
            assert time.monotonic() - started < 30.0  # not the group's 60 s timeout
            assert result.version == 1
            assert not torch.equal(_greedy_log_probs(kept), before)
            with pytest.raises(FailedPrecondition, match="broken"):
                group.update_weights(weights, version=2)
            group.close()
    finally:
        victim.kill()
        victim.wait()
        assert survivor.terminate_and_wait() == 0, survivor.log_text()


_UNSHARE = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child=SIGTERM"]


def _can_unshare() -> bool:
    try:
        return subprocess.run([*_UNSHARE, "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(not _can_unshare(), reason="needs unshare(1) with PID namespaces (root)")
def test_auto_falls_back_to_grpc_when_the_server_cannot_open_the_memfd(
    actor_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A server in another PID namespace cannot open /proc/<client pid>/fd/N. Even if the
    client wrongly believes it shares the host (forced here), "shm" fails with a clear status
    and "auto" logs a warning and sends the update over gRPC."""
    from rollserve.client.weights import upload

    proc, port = start_server_process("--device", "cpu", "--actor", str(actor_dir), prefix=_UNSHARE)
    target = f"127.0.0.1:{port}"
    try:
        with RolloutClient(target, timeout_s=WAIT_S) as client:
            server_id = client.weights_calls.health(WAIT_S).shm_host_id
            monkeypatch.setattr(upload, "shm_host_id", lambda: server_id)
            weights = {"model.norm.weight": torch.full((SPEC.hidden_size,), 0.5)}
            with pytest.raises(FailedPrecondition, match="does not exist on the server's host"):
                client.update_weights(weights, version=1, mode="partial", transport="shm")
            with caplog.at_level("WARNING", logger="rollserve.client.weights.upload"):
                result = client.update_weights(weights, version=1, mode="partial")
            assert (result.version, result.transport) == (1, "grpc")
            assert "sending this update over gRPC" in caplog.text
            # Remembered: the next "auto" update goes over gRPC without trying again.
            assert client.update_weights(weights, version=2, mode="partial").transport == "grpc"
    finally:
        # unshare does not pass SIGTERM on: stop the server itself, then unshare ends with it.
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        for child in children:
            os.kill(int(child), signal.SIGTERM)
        proc.terminate_and_wait()
